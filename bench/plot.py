#!/usr/bin/env python3
"""Plot benchmark results: bench/results/*.json -> docs/img/*.png.

For every results file (one per GPU) and every case with at least one successful row:

- ``bench_<gpu>_<case>_time.png``: time (ms, log scale) of every method, one bar group per
  problem size;
- ``bench_<gpu>_<case>_speedup.png``: our speed-up against the best peer of the same
  run (best-peer ms / our ms) for each size, one bar group per size;
- ``bench_<gpu>_memory.png``: peak memory (MB) of every method and size.

and for each time-to-solution file (``ttt_<gpu>.json``) ``bench_ttt_<gpu>.png``: our default
call against the best peer setting that reached the tolerance, one pair of bars per problem
(``bench_headline.png``, on the home page, is the H100 one); ``bench_mhc_projection.png``:
the mHC projection's forward time against the batch size, from ``mhc_h100.json``;
``bench_distributed.png``: one problem on one, two and four GPUs, from
``distributed_nvidia-h200x4.json``.

Usage::

    python bench/plot.py [--results bench/results] [--out docs/img]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUR_PREFIX = "flashsinkhorn-"
# Results of other benches (their tables are in docs/), not plotted here.
OTHER_RESULTS = ("divergence_", "distributed_", "mhc", "multiscale_", "otdd_", "shuffled_")
# The time-to-solution run drawn on the home page.
HEADLINE = "ttt_nvidia-h100-80gb-hbm3"
# The projection sweep drawn on the mHC page.
MHC_PROJECTION = "mhc_h100"


def load(results_dir: Path) -> dict[str, dict]:
    """Read every ``*.json`` results file in ``results_dir``: ``{stem: data}``."""
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"skip {path}: not JSON", file=sys.stderr)
            continue
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            out[path.stem] = data
    return out


def ok_rows(data: dict) -> list[dict]:
    """OT rows (with n and d; the mHC results have their own plots) with a time and no error."""
    return [
        r
        for r in data["rows"]
        if r.get("ms") is not None and not r.get("error") and "n" in r and "d" in r
    ]


# Figures are drawn at the width of the site's text column (about 690 px) so that their text
# reads at the size of the page's own.
WIDTH_IN = 6.4
DPI = 150
PEER_COLOURS = {"flash-sinkhorn": "#7f7f7f", "ott": "#17becf", "geomloss": "#bcbd22"}
OUR_COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e"]
OURS = "flashsinkhorn (tf32)"


def _size_label(key: tuple) -> str:
    B, n, m, d = key
    size = f"{n // 1000}k" if n % 1000 == 0 else str(n)
    return (f"{B} × " if B else "") + f"{size}², d={d}"


def _main_methods(rows: list[dict]) -> list[dict]:
    """Rows of the default squared-Euclidean cost at the default fp32 precision ("tf32"): the
    cost variants and the fp32-accurate "tf32x3" rows have their own tables."""
    return [r for r in rows if "-cost-" not in r["method"] and "tf32x3" not in r["method"]]


def _by_provider(rows: list[dict], field: str) -> dict[tuple, dict[str, float]]:
    """{size: {series: best value}}: our best method, and each peer's best method."""
    out: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in _main_methods(rows):
        if r.get(field) is None:
            continue
        key = (r.get("B") or 0, r["n"], r["m"], r["d"])
        name = OURS if r["method"].startswith(OUR_PREFIX) else r.get("provider", r["method"])
        out[key][name] = min(out[key].get(name, float("inf")), r[field])
    return out


def _num(v: float) -> str:
    """3 significant digits, without an exponent: 1.42, 44.6, 1,570, 38,200."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _plain_log_ticks(ax) -> None:
    """Tick labels of a log axis as plain numbers (0.5, 2, 50, 1000), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = ax.get_xlim()
    subs = (1.0,) if hi / lo > 1e3 else (1.0, 2.0, 5.0)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _bars(
    plt,
    groups: dict,
    labels: list[str],
    xlabel: str,
    title: str,
    path: Path,
    colours: dict[str, str] | None = None,
    log: bool = True,
) -> Path:
    """Horizontal bars, one group per row label, one bar per series present in the group."""
    names = sorted({n for g in groups.values() for n in g}, key=lambda n: (n != OURS, n))
    if colours is None:
        colours = {
            n: OUR_COLOURS[0] if n == OURS else PEER_COLOURS.get(n, "#8c564b") for n in names
        }
    names = [n for n in colours if n in names] + [n for n in names if n not in colours]
    height = max(2.2, sum(len(g) for g in groups.values()) * 0.24 + len(groups) * 0.25 + 1.2)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, height))
    y, ticks = 0.0, []
    for key, label in zip(groups, labels, strict=True):
        present = [n for n in names if n in groups[key]]
        start = y
        for n in present:
            ax.barh(y, groups[key][n], height=0.8, color=colours[n])
            ax.text(groups[key][n] * 1.05, y, _num(groups[key][n]), va="center", fontsize=7.5)
            y += 1
        ticks.append(((start + y - 1) / 2, label))
        y += 0.8
    ax.set_yticks([t for t, _ in ticks])
    ax.set_yticklabels([lab for _, lab in ticks], fontsize=9)
    ax.set_ylim(y - 0.4, -0.8)
    if log:
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, hi * 2.5)
        ax.set_xlabel(xlabel, fontsize=9)
        _plain_log_ticks(ax)
    else:
        ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
        ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title(title, fontsize=10, pad=24)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    ax.legend(handles, names, fontsize=8, ncol=len(names), loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_time(plt, stem: str, device: str, case: str, rows: list[dict], out: Path) -> Path:
    """Time of our best method and of each peer's best method, one bar group per size."""
    groups = dict(sorted(_by_provider(rows, "ms").items()))
    iters, eps = rows[0].get("iters", 10), rows[0].get("eps", 0.1)
    return _bars(
        plt,
        groups,
        [_size_label(k) for k in groups],
        "ms, median (lower is better)",
        f"{device}: {case}, {iters} iterations, eps = {eps}",
        out / f"bench_{stem}_{case}_time.png",
    )


def plot_speedup(
    plt, stem: str, device: str, case: str, rows: list[dict], out: Path
) -> Path | None:
    """Best-peer ms / our ms for each size and each of our methods."""
    rows = _main_methods(rows)
    sizes = defaultdict(list)
    for r in rows:
        sizes[(r.get("B") or 0, r["n"], r["m"], r["d"])].append(r)
    labels, series = [], defaultdict(list)
    ours_methods = sorted({r["method"] for r in rows if r["method"].startswith(OUR_PREFIX)})
    for key in sorted(sizes):
        grp = sizes[key]
        peers = [r["ms"] for r in grp if not r["method"].startswith(OUR_PREFIX)]
        if not peers or not ours_methods:
            continue
        best = min(peers)
        labels.append(_size_label(key))
        mine = {r["method"]: r["ms"] for r in grp}
        for meth in ours_methods:
            series[meth].append(best / mine[meth] if meth in mine else 0.0)
    if not labels:
        return None
    colours = dict(zip(ours_methods, OUR_COLOURS, strict=False))
    bar = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.9 + 0.25 * len(labels) * len(series)))
    for i, (meth, vals) in enumerate(sorted(series.items())):
        ys = [j + (len(series) - 1 - i) * bar for j in range(len(labels))]
        ax.barh(ys, vals, height=bar * 0.9, label=meth, color=colours[meth])
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_yticks([j + 0.4 - bar / 2 for j in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up against the best peer of the same run (×)", fontsize=9)
    ax.set_title(f"{device}: {case}", fontsize=10)
    ax.legend(fontsize=8, ncol=len(series), loc="upper center", bbox_to_anchor=(0.5, -0.25),
              frameon=False)  # fmt: skip
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    path = out / f"bench_{stem}_{case}_speedup.png"
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_memory(plt, stem: str, device: str, rows: list[dict], out: Path) -> Path | None:
    """Peak memory of our best method and of each peer's, forward and forward + backward."""
    groups, labels = {}, []
    for case in ("fwd", "fwdbwd"):
        for key, g in sorted(
            _by_provider([r for r in rows if r["case"] == case], "peak_mb").items()
        ):
            groups[(case, *key)] = g
            labels.append(f"{case} {_size_label(key)}")
    if not groups:
        return None
    return _bars(
        plt,
        groups,
        labels,
        "peak memory, MB, inputs included (lower is better)",
        f"{device}: peak memory",
        out / f"bench_{stem}_memory.png",
    )


def _problem_label(r: dict) -> str:
    size = f"{r['n'] // 1000}k²" if r["n"] % 1000 == 0 else f"{r['n']}²"
    label = (f"{r['B']} × " if r.get("B") else "") + f"{size}, d={r['d']}"
    if r["case"] == "shape3d":
        return label + ", 3-D shapes"
    if r["case"] == "mix16":
        return label + ", mixtures"
    label += f", ε={r['eps']:g}"
    return label + (f", ρ={r['rho']:g}" if r.get("rho") else "")


def plot_headline(plt, device: str, data: dict, out: Path, name: str) -> Path | None:
    """Time to solution of our default call against the best peer that reached the tolerance
    (the fastest peer, hatched, where none did), one pair of bars per problem."""
    problems: dict[str, dict] = {}
    for r in data["rows"]:
        if r.get("ms") is None or not r.get("problem"):
            continue
        entry = problems.setdefault(r["problem"], {"row": r, "ours": None, "peers": []})
        reached = r.get("reached_tol", r.get("converged"))
        if r["method"] == "ours-default":
            entry["ours"] = r["ms"]
        elif r.get("provider") != "ours":
            entry["peers"].append((r["ms"], bool(reached), r["method"]))
    rows = [e for e in problems.values() if e["ours"] is not None and e["peers"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.8 + 0.62 * len(rows)))
    for j, e in enumerate(rows):
        reached = [p for p in e["peers"] if p[1]]
        ms, ok, method = min(reached) if reached else min(e["peers"])
        ax.barh(j - 0.2, e["ours"], height=0.38, color=OUR_COLOURS[0])
        ax.barh(
            j + 0.2,
            ms,
            height=0.38,
            color=PEER_COLOURS["flash-sinkhorn"],
            hatch=None if ok else "//",
        )
        note = f"{method}: {ms / e['ours']:.0f}× slower" if ok else f"{method}: not reached"
        ax.text(ms * 1.08, j + 0.2, note, va="center", fontsize=7.5)
        ax.text(e["ours"] * 1.08, j - 0.2, f"{e['ours']:.3g} ms", va="center", fontsize=7.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_problem_label(e["row"]) for e in rows], fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xscale("log")
    lo = min(e["ours"] for e in rows)
    hi = max(max(p[0] for p in e["peers"]) for e in rows)
    ax.set_xlim(lo / 2, hi * 40)
    ax.set_xlabel(
        f"ms to a marginal error of {data.get('tol', 1e-3):g} (lower is better)", fontsize=9
    )
    _plain_log_ticks(ax)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=OUR_COLOURS[0]),
        plt.Rectangle((0, 0), 1, 1, color=PEER_COLOURS["flash-sinkhorn"]),
    ]
    ax.legend(handles, ["flashsinkhorn, default call", "best peer setting, same run"],
              fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12),
              frameon=False)  # fmt: skip
    ax.set_title(f"{device}: time to solution", fontsize=10)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


MHC_SERIES = {
    "ours: sinkhorn_knopp call [float32]": (
        "flashsinkhorn.mhc.sinkhorn_knopp",
        OUR_COLOURS[0],
        "-",
    ),
    "torch loop, torch.compile (inductor) [float32]": (
        "PyTorch loop, torch.compile",
        "#17becf",
        "--",
    ),
    "torch loop, eager [float32]": ("PyTorch loop, eager", "#7f7f7f", "--"),
    "device copy, same bytes as fwd": ("device copy of the same bytes", "#000000", ":"),
}


def plot_mhc_projection(plt, device: str, data: dict, out: Path) -> Path | None:
    """Forward time of the batched 4 × 4 Sinkhorn–Knopp projection against the batch size."""
    lines = defaultdict(list)
    for r in data["rows"]:
        case = r.get("case", "")
        kind, _, b = case.partition(" B=")
        if kind in ("proj_fwd", "copy") and r.get("ms") is not None and r["method"] in MHC_SERIES:
            lines[r["method"]].append((int(b), r["ms"]))
    if len(lines) < 2:
        return None
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.6))
    for method, (label, colour, style) in MHC_SERIES.items():
        pts = sorted(lines.get(method, []))
        if pts:
            ax.plot(*zip(*pts, strict=True), style, color=colour, marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("matrices per call, B (n = 4, 20 iterations, fp32)", fontsize=9)
    ax.set_ylabel("ms per call, median", fontsize=9)
    ax.set_title(f"{device}: Sinkhorn–Knopp projection, forward", fontsize=10, pad=38)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    path = out / "bench_mhc_projection.png"
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_distributed(plt, rows: list[dict], out: Path) -> Path | None:
    """Time of one solve on one GPU and sharded over more, both modes: 10 symmetric
    iterations at 2·10⁶ and 4·10⁶ points, and the default to tol 1e-3 at 2·10⁶."""
    groups: dict[tuple, dict[str, float]] = defaultdict(dict)
    device = None
    for r in rows:
        case, n = r.get("case"), r.get("n")
        if case not in ("distributed_fixed", "distributed_tol") or n < 2_000_000:
            continue
        device = r.get("device")
        gpus = "1 GPU" if r["world_size"] == 1 else f"{r['world_size']} GPUs, {r['mode']}"
        groups[(case == "distributed_tol", n)][gpus] = r["ms"] / 1e3
    if not groups:
        return None
    order = ["1 GPU"] + [f"{w} GPUs, {m}" for w in (2, 4, 8) for m in ("gather", "ring")]
    names = [g for g in order if any(g in v for v in groups.values())]
    palette = ["#7f7f7f", "#ff9896", "#d62728", "#aec7e8", "#1f77b4", "#98df8a", "#2ca02c"]
    colours = dict(zip(names, palette, strict=False))
    groups = {k: {g: v[g] for g in names if g in v} for k, v in sorted(groups.items())}
    labels = [f"{n / 1e6:g}M², " + ("default to tol 1e-3" if tol else "10 iterations")
              for tol, n in groups]  # fmt: skip
    return _bars(
        plt,
        dict(zip(labels, groups.values(), strict=True)),
        labels,
        "seconds (log scale, lower is better)",
        f"{device}: one problem sharded with torch.distributed, d=64",
        out / "bench_distributed.png",
        colours,
        log=True,
    )


def main(argv=None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--results", default=str(BENCH / "results"))
    p.add_argument("--out", default=str(ROOT / "docs" / "img"))
    p.add_argument("--include-smoke", action="store_true", help="also plot peers_smoke_*.json")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    distributed = Path(args.results) / "distributed_nvidia-h200x4.json"
    if distributed.is_file():
        written.append(plot_distributed(plt, json.loads(distributed.read_text()), out))
    for stem, data in load(Path(args.results)).items():
        if stem.startswith("peers_smoke") and not args.include_smoke:
            continue
        device = data.get("device") or stem
        if stem.startswith("ttt_"):
            written.append(plot_headline(plt, device, data, out, f"bench_{stem}.png"))
            if stem == HEADLINE:
                written.append(plot_headline(plt, device, data, out, "bench_headline.png"))
            continue
        if stem == MHC_PROJECTION:
            written.append(plot_mhc_projection(plt, device, data, out))
        if stem.startswith(OTHER_RESULTS):
            continue
        rows = ok_rows(data)
        for case in sorted({r["case"] for r in rows if r["case"] != "firstcall"}):
            crow = [r for r in rows if r["case"] == case]
            written.append(plot_time(plt, stem, device, case, crow, out))
            written.append(plot_speedup(plt, stem, device, case, crow, out))
        written.append(plot_memory(plt, stem, device, rows, out))
    for path in filter(None, written):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
