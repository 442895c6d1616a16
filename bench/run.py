#!/usr/bin/env python3
"""flashsinkhorn benchmark driver: cases x providers, one JSON file per GPU.

Usage::

    python bench/run.py --cases fwd,fwdbwd,batched,firstcall \\
        --providers ours,flash-sinkhorn,geomloss,ott --out bench/results [--quick]
    python bench/run.py --cases fwd --providers geomloss,ott --device cpu --quick   # CPU smoke

Protocol (bench/README.md): x, y ~ U[0,1]^d, random normalised weights, eps = 0.1 for the full
squared-Euclidean cost, a fixed 10 iterations (no annealing, no early stop), fp32 inputs,
TF32 allowed, CUDA-event timing, median after warm-up, first call reported separately.

Each provider x case runs in its own worker process (this same file with ``--worker``),
which prints one ``@@ROW {json}`` line per measurement. An error inside a measurement
(import error, OOM, unsupported call) becomes a row with an ``error`` field; if the worker
dies (segfault) or stalls past ``--item-timeout``, the item in progress gets an error row
and a new worker continues with the remaining items. Rows are merged into
``<out>/<gpu-name-slug>.json``; rows with the same (case, n, m, d, B, method) are replaced.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(BENCH), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import cases as _cases  # noqa: E402
import providers as _providers  # noqa: E402

ROW_TAG = "@@ROW "
INFO_TAG = "@@INFO "
KEY_FIELDS = ("case", "n", "m", "d", "B", "method")
OUR_PREFIX = "flashsinkhorn-"


# ----------------------------------------------------------------------------- worker side


def _base_row(case, size, method, provider, opts) -> dict:
    row = {
        "case": case.name,
        "n": size.n,
        "m": size.m,
        "d": size.d,
        "iters": opts.iters,
        "eps": opts.eps,
        "method": method,
        "provider": provider,
    }
    if size.B:
        row["B"] = size.B
    return row


def _emit(tag: str, obj: dict) -> None:
    sys.stdout.write(tag + json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker_main(args) -> int:
    """Run the (size, method) items given in ``--items`` for one provider and one case."""
    from providers._timing import Timing, allow_tf32, release

    allow_tf32()
    case = _cases.CASES[args.case]
    items = json.loads(args.items)
    opts = _providers.Options(
        device=args.device,
        eps=args.eps,
        iters=args.iters,
        timing=Timing.quick() if args.quick else Timing(),
        precisions=tuple(args.precisions.split(",")),
        ours_backend=args.ours_backend,
    )
    prov = _providers.get(args.worker)

    def get_versions():
        try:
            return prov.versions(), None
        except Exception as exc:  # the library is missing or broken: every item gets the error
            return {}, "import failed: " + _providers.short_error(exc)

    # The first-call case must import the library itself, inside its timed region.
    versions, import_error = ({}, None) if case.kind == "firstcall" else get_versions()
    _emit(INFO_TAG, {"versions": versions})

    for size_d, method in items:
        size = _cases.Size.from_dict(size_d)
        row = _base_row(case, size, method, args.worker, opts)
        if import_error:
            row["error"] = import_error
            _emit(ROW_TAG, row)
            continue
        print(
            f"[{args.worker}] {case.name} {size.label()} {method} ...", file=sys.stderr, flush=True
        )
        t0 = time.perf_counter()
        try:
            row.update(prov.run_item(case, size, method, opts))
            if row.get("ms") is not None:
                row["ms_per_iter"] = row["ms"] / row.get("iters", opts.iters)
        except Exception as exc:
            row["error"] = _providers.short_error(exc)
            print(_providers.error_trace(exc), file=sys.stderr, flush=True)
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        if not versions:
            versions = get_versions()[0]
            _emit(INFO_TAG, {"versions": versions})
        if versions:
            row["versions"] = versions
        _emit(ROW_TAG, row)
        release(args.device)
    return 0


def info_main(args) -> int:
    """Print device and library versions as one JSON line."""
    import torch

    try:
        import triton

        triton_v = triton.__version__
    except Exception:
        triton_v = None
    if args.device == "cpu":
        name = "cpu"
    elif torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    else:
        name = None
    _emit(
        INFO_TAG,
        {
            "device": name,
            "torch": torch.__version__,
            "triton": triton_v,
            "cuda": torch.version.cuda,
        },
    )
    return 0


# ----------------------------------------------------------------------------- driver side


def slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _worker_cmd(args, provider: str, case_name: str, items) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        provider,
        "--case",
        case_name,
        "--items",
        json.dumps(items),
        "--device",
        args.device,
        "--eps",
        repr(args.eps),
        "--iters",
        str(args.iters),
        "--precisions",
        args.precisions,
    ]
    if args.quick:
        cmd.append("--quick")
    if args.ours_backend:
        cmd += ["--ours-backend", args.ours_backend]
    return cmd


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_worker(args, provider, case, items, env, log, on_row=None) -> tuple[list[dict], dict]:
    """Run ``items`` in fresh worker processes until each has a row.

    A worker that dies or stalls costs the item in progress an error row; a new worker
    takes the rest. ``on_row(row, versions)`` is called as each row arrives (the caller saves
    it at once, so a run stopped from outside keeps every row it printed).
    """
    rows: list[dict] = []
    versions: dict = {}
    remaining = list(items)
    while remaining:
        proc = subprocess.Popen(
            _worker_cmd(args, provider, case.name, remaining),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,  # its own process group, so a stall can be killed whole
        )
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
        last = time.monotonic()
        timed_out = False
        while True:
            try:
                line = q.get(timeout=5)
            except queue.Empty:
                if time.monotonic() - last > args.item_timeout:
                    timed_out = True
                    _kill(proc)
                    break
                continue
            if line is None:
                break
            if line.startswith(ROW_TAG):
                row = json.loads(line[len(ROW_TAG) :])
                rows.append(row)
                key = [
                    {"n": row["n"], "m": row["m"], "d": row["d"], "B": row.get("B")},
                    row["method"],
                ]
                if key in remaining:
                    remaining.remove(key)
                last = time.monotonic()
                _progress(row)
                if on_row is not None:
                    on_row(row, versions)
            elif line.startswith(INFO_TAG):
                versions.update(json.loads(line[len(INFO_TAG) :]).get("versions", {}))
            else:
                log.write(line)
        rc = proc.wait()
        if not remaining:
            break
        size_d, method = remaining.pop(0)
        size = _cases.Size.from_dict(size_d)
        row = _base_row(case, size, method, provider, args)
        if timed_out:
            row["error"] = f"timeout: no result after {args.item_timeout:.0f} s (worker killed)"
        else:
            how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            row["error"] = f"worker crashed ({how}); see the worker log"
        rows.append(row)
        _progress(row)
        if on_row is not None:
            on_row(row, versions)
    return rows, versions


def _progress(row: dict) -> None:
    size = f"{row['n']}x{row['m']} d={row['d']}" + (f" B={row['B']}" if row.get("B") else "")
    if row.get("error"):
        msg = "ERROR " + row["error"][:160]
    else:
        msg = f"{row['ms']:.3f} ms"
        if row.get("first_call_s") is not None:
            msg += f"  first {row['first_call_s']:.2f} s"
    print(f"  {row['case']:9s} {size:24s} {row['method']:26s} {msg}", flush=True)


def row_key(row: dict) -> tuple:
    """Identity of a row in the results file."""
    return tuple(row.get(k) for k in KEY_FIELDS)


def merge_results(path: Path, info: dict, new_rows: list[dict], versions: dict) -> dict:
    """Merge ``new_rows`` into the JSON file at ``path`` (replacing rows with the same key)."""
    data = {
        "device": info.get("device"),
        "torch": info.get("torch"),
        "triton": info.get("triton"),
        "rows": [],
    }
    if path.exists():
        try:
            data.update(json.loads(path.read_text()))
        except json.JSONDecodeError:
            print(f"warning: {path} is not valid JSON; starting a new file", file=sys.stderr)
    for k in ("device", "torch", "triton", "cuda"):
        if info.get(k):
            data[k] = info[k]
    data.setdefault("versions", {}).update(versions)
    new_keys = {row_key(r) for r in new_rows}
    rows = [r for r in data.get("rows", []) if row_key(r) not in new_keys] + new_rows
    order = {name: i for i, name in enumerate(_cases.CASES)}
    rows.sort(
        key=lambda r: (
            order.get(r["case"], 99),
            r.get("B") or 0,
            r["n"],
            r["m"],
            r["d"],
            r["method"],
        )
    )
    data["rows"] = rows
    data["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results_json(data))
    return data


def results_json(data: dict) -> str:
    """The results file as text: top-level keys indented, one row per line (diffs stay short)."""
    parts = []
    for k, v in data.items():
        if k == "rows":
            rows = ",\n".join("  " + json.dumps(r) for r in v)
            parts.append(f' "rows": [\n{rows}\n ]')
        else:
            parts.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def format_table(rows: list[dict]) -> str:
    """Text table: ms, ms/iter, peak MB, first call, and speed relative to the best peer.

    ``vs best peer`` is best-peer-ms / ms: above 1 is faster than every peer of the run.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r.get("B") or 0, r["n"], r["m"], r["d"]), []).append(r)
    lines = [
        f"{'case':9s} {'size':24s} {'method':26s} {'ms':>10s} {'ms/it':>8s} {'peak MB':>9s} "
        f"{'first s':>8s} {'vs best peer':>13s}",
        "-" * 114,
    ]
    for (case, B, n, m, d), grp in groups.items():
        peers = [
            r
            for r in grp
            if not r["method"].startswith(OUR_PREFIX) and r.get("ms") and not r.get("error")
        ]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        size = f"{n}x{m} d={d}" + (f" B={B}" if B else "")
        for r in sorted(grp, key=lambda r: (not r["method"].startswith(OUR_PREFIX), r["method"])):
            if r.get("error"):
                lines.append(
                    f"{case:9s} {size:24s} {r['method']:26s} {'error: ' + r['error'][:60]}"
                )
                continue
            peak = f"{r['peak_mb']:.0f}" if r.get("peak_mb") is not None else "-"
            first = f"{r['first_call_s']:.2f}" if r.get("first_call_s") is not None else "-"
            ratio = f"{best['ms'] / r['ms']:.2f}x" if best else "-"
            per_it = r["ms"] / r["iters"]
            lines.append(
                f"{case:9s} {size:24s} {r['method']:26s} {r['ms']:10.3f} {per_it:8.3f} "
                f"{peak:>9s} {first:>8s} {ratio:>13s}"
            )
        if best:
            lines.append(f"{'':9s} {'':24s} best peer: {best['method']} {best['ms']:.3f} ms")
    return "\n".join(lines)


def _device_info(args, env) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--info", "--device", args.device]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    for line in res.stdout.splitlines():
        if line.startswith(INFO_TAG):
            return json.loads(line[len(INFO_TAG) :])
    raise SystemExit(f"could not read device info:\n{res.stderr}")


def driver_main(args) -> int:
    """Plan the items, run every provider x case in workers, merge and print."""
    case_names = [c for c in args.cases.split(",") if c]
    prov_names = [p for p in args.providers.split(",") if p]
    for c in case_names:
        if c not in _cases.CASES:
            raise SystemExit(f"unknown case {c!r}; known: {', '.join(_cases.CASES)}")
    for p in prov_names:
        if p not in _providers.REGISTRY:
            raise SystemExit(f"unknown provider {p!r}; known: {', '.join(_providers.REGISTRY)}")

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    tmp = Path(tempfile.mkdtemp(prefix="fsbench-"))
    if "TRITON_CACHE_DIR" not in os.environ and not args.keep_triton_cache:
        env["TRITON_CACHE_DIR"] = str(tmp / "triton-run")  # shared by this run's workers

    info = _device_info(args, env)
    if info.get("device") is None:
        raise SystemExit("no CUDA device visible; use --device cpu for a CPU smoke test")
    out_dir = Path(args.out)
    out_path = out_dir / f"{args.name or slug(info['device'])}.json"
    print(
        f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}  -> {out_path}",
        flush=True,
    )

    if args.log:
        log_path = Path(args.log)
    elif out_dir.resolve() == (BENCH / "results").resolve():
        log_path = tmp / "bench_workers.log"  # keep logs out of the tracked results folder
    else:
        log_path = out_dir / "bench_workers.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    opts = _providers.Options(device=args.device, precisions=tuple(args.precisions.split(",")))
    all_rows: list[dict] = []
    versions: dict = {}
    with open(log_path, "a") as log:
        log.write(
            f"\n=== {_dt.datetime.now().isoformat(timespec='seconds')} {' '.join(sys.argv)}\n"
        )
        for case_name in case_names:
            case = _cases.CASES[case_name]
            sizes = (
                _cases.parse_sizes(args.sizes, case.kind, args.batch)
                if args.sizes and case.kind != "firstcall"
                else case.select(args.device, args.quick)
            )
            for prov_name in prov_names:
                prov = _providers.get(prov_name)
                methods = prov.methods(case.kind, opts)
                if args.methods:
                    wanted = set(args.methods.split(","))
                    methods = [mth for mth in methods if mth in wanted]
                items = [[s.as_dict(), mth] for s in sizes for mth in methods]
                if not items:
                    continue
                wenv = dict(env)
                if case.kind == "firstcall":  # a cold compiler cache for the first-call case
                    wenv["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-", dir=tmp)
                batches = [[it] for it in items] if prov.isolate == "item" else [items]
                for batch in batches:
                    # save each row as it comes, so an interrupted run keeps what it measured
                    rows, vers = run_worker(
                        args, prov_name, case, batch, wenv, log,
                        on_row=lambda r, v: merge_results(out_path, info, [r], v),
                    )  # fmt: skip
                    all_rows += rows
                    versions.update(vers)

    print()
    print(format_table(all_rows))
    print(f"\nresults: {out_path}   worker log: {log_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface (driver and internal worker modes)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cases",
        default="fwd,fwdbwd,batched,firstcall",
        help="comma list: " + ",".join(_cases.CASES),
    )
    p.add_argument(
        "--providers",
        default="ours,flash-sinkhorn,geomloss,ott",
        help="comma list: " + ",".join(_providers.REGISTRY),
    )
    p.add_argument("--methods", default=None, help="only these method names (comma list)")
    p.add_argument("--out", default=str(BENCH / "results"), help="folder for <gpu-slug>.json")
    p.add_argument("--name", default=None, help="results file stem (default: slug of the GPU name)")
    p.add_argument(
        "--log",
        default=None,
        help="worker log (default: <out>/bench_workers.log; a temp file for bench/results)",
    )
    p.add_argument(
        "--quick", action="store_true", help="first size of each case, fewer repetitions"
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--sizes", default=None, help="override sizes: NxD or NxMxD, comma separated")
    p.add_argument(
        "--batch", type=int, default=None, help="batch size with --sizes for batched cases"
    )
    p.add_argument("--eps", type=float, default=_cases.EPS)
    p.add_argument("--iters", type=int, default=_cases.ITERS)
    p.add_argument(
        "--precisions", default="tf32", help="our precision modes, e.g. tf32,ieee,tf32x3"
    )
    p.add_argument(
        "--ours-backend", default=None, help="backend for flashsinkhorn.sinkhorn (default triton)"
    )
    p.add_argument(
        "--item-timeout", type=float, default=600.0, help="seconds without a result before a kill"
    )
    p.add_argument(
        "--keep-triton-cache", action="store_true", help="use the default Triton cache folder"
    )
    # internal
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--items", default=None, help=argparse.SUPPRESS)
    p.add_argument("--info", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--show", nargs="+", default=None, help="print the table of results files and exit"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="merge results files (e.g. fetched from the GPU machine) into <out>/<same name>",
    )
    return p


def main(argv=None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    if args.show:
        for path in args.show:
            data = json.loads(Path(path).read_text())
            dev, tv, trv = data.get("device"), data.get("torch"), data.get("triton")
            print(f"{path}: {dev}  torch {tv}  triton {trv}")
            print(format_table(data.get("rows", [])))
        return 0
    if args.merge:
        for path in map(Path, args.merge):
            data = json.loads(path.read_text())
            info = {k: data.get(k) for k in ("device", "torch", "triton", "cuda")}
            dest = Path(args.out) / path.name
            merged = merge_results(dest, info, data.get("rows", []), data.get("versions", {}))
            print(f"{path} -> {dest} ({len(merged['rows'])} rows)")
        return 0
    if args.info:
        return info_main(args)
    if args.worker:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
