"""The parent process: reference solves, one subprocess per (provider, case), the results
file and the table."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .judge import TOL
from .problems import CASES, make_problems
from .providers import versions as provider_versions
from .timing import device_name, slug
from .worker import worker_main

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
#: the entry point the workers are started from
SCRIPT = BENCH / "bench_ttt.py"
PROVIDERS = ("ours", "ott", "geomloss", "flash-sinkhorn")
DEFAULT_PROVIDERS = "ours,ott,geomloss"


def run_item(args, provider: str, case: str, seconds: float, refs_path: str | None) -> list[dict]:
    """One (provider, case) in a fresh subprocess; its rows, or an error row."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as tmp:
        path = tmp.name
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--worker",
        provider,
        "--cases",
        case,
        "--device",
        args.device,
        "--worker-out",
        path,
        "--max-seconds",
        f"{seconds:.1f}",
    ]
    if args.quick:
        cmd.append("--quick")
    if refs_path:
        cmd += ["--refs", refs_path]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    timeout = seconds + args.grace
    t0 = time.time()
    err = None
    try:
        proc = subprocess.run(
            cmd, env=env, timeout=timeout, stdout=None, stderr=subprocess.PIPE, text=True
        )
        if proc.returncode != 0:
            err = f"worker exit {proc.returncode}: " + " | ".join(
                proc.stderr.strip().splitlines()[-3:]
            )
    except subprocess.TimeoutExpired:
        err = f"worker timed out after {timeout:.0f} s"
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    os.unlink(path)
    if err:
        print(f"  {provider}/{case}: {err[:400]}", flush=True)
        rows.append(
            {
                "case": case,
                "provider": provider,
                "method": f"{provider}-*",
                "error": err[:400],
                "wall_s": round(time.time() - t0, 1),
            }
        )
    return rows


def row_key(r: dict) -> tuple:
    return (r.get("case"), r.get("problem"), r.get("n"), r.get("B"), r.get("method"))


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'problem':26s} {'size':20s} {'method':26s} {'ms':>10s} {'iters':>6s} "
        f"{'error':>10s} {'fp64 check':>10s} {'|dv| to ref':>11s}  notes"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r.get('n')}x{r.get('m')} d={r.get('d')}" + (f" B={r['B']}" if r.get("B") else "")
        name = f"{r.get('problem', r.get('case', '')):26s} {size:20s} {r.get('method', ''):26s}"
        if r.get("error") or r.get("skipped"):
            what = "error: " + r["error"] if r.get("error") else "skipped: " + r["skipped"]
            lines.append(f"{name} {what[:90]}")
            continue
        dv = f"{r['value_err']:.1e}" if r.get("value_err") is not None else "-"
        c = r.get("marginal_error_check")
        check = "-" if c is None else f"{c:.2e}"
        notes = []
        if not r.get("reached_tol"):
            notes.append("TOL NOT REACHED")
        if r.get("calibrated"):
            notes.append(r["calibrated"])
        if r.get("converged") is False:
            notes.append(f"not converged (cap {r.get('iter_cap')})")
        lines.append(
            f"{name} {r['ms']:10.2f} {str(r.get('n_iters', '-')):>6s} "
            f"{r['marginal_error']:10.2e} {check:>10s} {dv:>11s}  {'; '.join(notes)}"
        )
    return "\n".join(lines)


def pick(csv: str, allowed, what: str) -> list[str]:
    """The names of a comma-separated option, each checked against ``allowed``."""
    names = [q for q in csv.split(",") if q]
    for q in names:
        if q not in allowed:
            raise SystemExit(f"unknown {what} {q!r}; choose from {', '.join(allowed)}")
    return names


def driver_main(args) -> int:
    cases = pick(args.cases, CASES, "case")
    provs = pick(args.providers, PROVIDERS, "provider")
    provs = [p for p in PROVIDERS if p in provs]  # flash-sinkhorn last
    out_dir = Path(args.out or os.environ.get("OUT") or BENCH / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev_name = device_name(args.device)
    stem = slug(dev_name) + ("_quick" if args.quick else "")
    out_path = out_dir / f"ttt_{stem}.json"
    ref_path = out_dir / f"ttt_ref_{stem}.json"
    refs = json.loads(ref_path.read_text()) if ref_path.exists() else {}
    left = {p: float(args.max_seconds) for p in provs}
    ref_left = float(args.ref_seconds)
    new_rows: list[dict] = []
    versions: dict = {}
    t_start = time.time()
    print(f"time to solution, tol={TOL:g}, device {dev_name}, cases {cases}, providers {provs}")
    for case in cases:
        missing = [p for p in make_problems(case, args.quick) if p.key() not in refs]
        if missing:
            t0 = time.time()
            for r in run_item(args, "ref", case, max(30.0, ref_left), None):
                if r.get("kind") == "ref":
                    refs[r["key"]] = {k: v for k, v in r.items() if k not in ("kind", "provider")}
            ref_left -= time.time() - t0
            ref_path.write_text(json.dumps(refs, indent=1) + "\n")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
            json.dump(refs, tmp)
            refs_tmp = tmp.name
        for prov in provs:
            if left[prov] < 5:
                new_rows.append(
                    {
                        "case": case,
                        "provider": prov,
                        "method": f"{prov}-*",
                        "skipped": "provider time budget (--max-seconds) spent",
                    }
                )
                continue
            t0 = time.time()
            new_rows += run_item(args, prov, case, left[prov], refs_tmp)
            left[prov] -= time.time() - t0
        os.unlink(refs_tmp)
    for prov in provs:
        versions.update(provider_versions(prov))
    import torch

    info = {"device": dev_name, "torch": torch.__version__, "tol": TOL, "quick": args.quick}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    keep = {row_key(r) for r in new_rows}
    old = json.loads(out_path.read_text()).get("rows", []) if out_path.exists() else []
    rows = [r for r in old if row_key(r) not in keep] + new_rows
    order = {c: i for i, c in enumerate(CASES)}
    rows.sort(
        key=lambda r: (
            order.get(r.get("case"), 99),
            str(r.get("problem")),
            PROVIDERS.index(r["provider"]) if r.get("provider") in PROVIDERS else 9,
        )
    )
    data = {
        **info,
        "versions": versions,
        "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    try:
        from run import results_json

        text = results_json(data)
    except Exception:  # noqa: BLE001
        text = json.dumps(data, indent=1) + "\n"
    out_path.write_text(text)
    print()
    print(format_table(rows))
    print(
        f"\nwrote {out_path} ({len(new_rows)} new rows) in {time.time() - t_start:.0f} s; "
        f"time left per provider: { {k: round(v) for k, v in left.items()} }"
    )
    return 0


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument(
        "--providers",
        default=DEFAULT_PROVIDERS,
        help=f"comma list of {', '.join(PROVIDERS)} (default {DEFAULT_PROVIDERS})",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--quick", action="store_true", help="n = m = 2000, B = 8 (smoke test)")
    p.add_argument("--out", default=None, help="folder for ttt_<gpu-slug>.json (default $OUT)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=130.0,
        help="time budget of each provider over all cases (default 130)",
    )
    p.add_argument(
        "--ref-seconds",
        type=float,
        default=100.0,
        help="time budget of the reference solves over all cases (default 100)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=60.0,
        help="seconds past its budget before a worker is killed (default 60)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--refs", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None, description: str | None = None) -> int:
    """The command line of ``bench/bench_ttt.py``: a worker with ``--worker``, else the driver."""
    args = build_parser(description).parse_args(argv)
    if args.worker:
        return worker_main(args)
    return driver_main(args)
