"""The subprocess side: one (provider, case), one JSON line per row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .judge import TOL
from .problems import make_problems
from .providers import REFERENCE, WORKERS
from .timing import Budget

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent


def worker_main(args) -> int:
    """Runs one (provider, case) and appends one JSON line per row to ``args.worker_out``."""
    for path in (str(BENCH), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    problems = make_problems(args.cases, args.quick)
    refs = json.loads(Path(args.refs).read_text()) if args.refs else {}
    device = args.device
    out = open(args.worker_out, "a", encoding="utf-8")  # noqa: SIM115
    state = {"p": problems[0]}

    def emit(row: dict) -> None:
        p = state["p"]
        base = {
            "case": p.case,
            "problem": p.pid,
            **p.shape(),
            "eps": p.eps,
            "rho": p.rho,
            "tol": TOL,
            "provider": args.worker,
        }
        if row.get("kind") != "ref":
            r = refs.get(p.key(), {})
            base.update({k: r[k] for k in ("ref_note", "ref_error") if k in r})
        out.write(json.dumps({**base, **row}) + "\n")
        out.flush()
        print(
            f"  {args.worker:14s} {p.pid:28s} {row.get('method', 'reference'):24s} " + _brief(row),
            flush=True,
        )

    budget = Budget(args.max_seconds, len(problems) * (6 if args.worker == "ours" else 3))
    fn = REFERENCE if args.worker == "ref" else WORKERS[args.worker]
    for p in problems:
        state["p"] = p
        fn(p, device, budget, emit, refs)
    out.close()
    return 0


def _brief(row: dict) -> str:
    if row.get("error") or row.get("skipped"):
        return f"{'error' if row.get('error') else 'skipped'}: {row.get('error') or row['skipped']}"
    if row.get("kind") == "ref":
        return f"ref {row['ref_note']}: iters={row['ref_iters']} err={row['ref_error']:.1e}"
    return (
        f"{row['ms']:10.2f} ms  it={row.get('n_iters')}  err={row['marginal_error']:.2e}  "
        f"dv={row.get('value_err', float('nan')):.1e}"
    )
