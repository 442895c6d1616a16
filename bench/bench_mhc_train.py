"""Training step of a 12-layer causal transformer whose residual stream is widened to n = 4
streams with mHC: our layer against the PyTorch reference layer, eager and torch.compile'd.

Each block has two hyper-connected sub-layers (causal attention through
``scaled_dot_product_attention``, and a GELU MLP), each with its own layer index; the token
embedding is copied into the streams and the streams are averaged before the head. A step is
forward, cross-entropy, backward and AdamW, under ``torch.autocast`` (bf16 on the GPU by
default). The compiled variants compile the model with ``fullgraph=True``; compilation and the
first steps are excluded from the timed region (reported as ``first_steps_s``). Reported per
variant: ms per step (median over steps, q01–q99), tokens/s, peak memory of the timed steps,
and the first step's loss (the same model and data for every variant).

    python bench/bench_mhc_train.py --out out            # H100: ≈ 5 min (mostly compiling)
    python bench/bench_mhc_train.py --variants ours-eager,ours-compiled
    python bench/bench_mhc_train.py --quick --out /tmp/q # tiny model, also on a CPU (< 60 s)

Output: ``mhc_train_<gpu>[_quick].json`` in ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import time

import mhc_results
import torch
import torch.nn.functional as F
from torch import nn

from flashsinkhorn.mhc import HyperConnection, HyperConnectionReference

VARIANTS = ("ours-eager", "ours-compiled", "reference-eager", "reference-compiled")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, d = u.shape
        q, k, v = self.qkv(u).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, n: int, index: int, hc_cls):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim)
        )
        self.hc_attn = hc_cls(dim, n, layer_idx=2 * index)
        self.hc_mlp = hc_cls(dim, n, layer_idx=2 * index + 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.hc_attn(h, lambda u: self.attn(self.norm1(u)))
        return self.hc_mlp(h, lambda u: self.mlp(self.norm2(u)))


class MHCTransformer(nn.Module):
    def __init__(self, vocab, dim, heads, layers, n, hc_cls):
        super().__init__()
        self.n = n
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, n, i, hc_cls) for i in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1])
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h.mean(-2)))


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(name, cfg, device, amp_dtype, state, data, steps, warmup, compile_backend):
    ours = name.startswith("ours")
    torch.manual_seed(0)
    model = MHCTransformer(
        cfg["vocab"],
        cfg["dim"],
        cfg["heads"],
        cfg["layers"],
        4,
        HyperConnection if ours else HyperConnectionReference,
    ).to(device)
    model.load_state_dict(state)
    fwd = model
    if name.endswith("compiled"):
        fwd = torch.compile(model, backend=compile_backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, targets = data

    def step():
        with torch.autocast(device, amp_dtype, enabled=amp_dtype is not None):
            logits = fwd(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    first_loss = step().item()
    for _ in range(warmup - 1):
        step()
    _sync(device)
    first_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    q = torch.tensor(times, dtype=torch.float64)
    ms = float(q.quantile(0.5))
    row = {
        "variant": name,
        "ms_per_step": ms,
        "q01": float(q.quantile(0.01)),
        "q99": float(q.quantile(0.99)),
        "steps": steps,
        "tokens_per_s": tokens.numel() / (ms * 1e-3),
        "peak_gib": None if peak is None else round(peak, 3),
        "first_loss": first_loss,
        "first_steps_s": round(first_s, 2),
    }
    print(
        f"{name:20s} {ms:9.2f} ms/step [{row['q01']:.2f}, {row['q99']:.2f}] "
        f"{row['tokens_per_s']:12.0f} tok/s  peak {row['peak_gib']} GiB  "
        f"loss0 {first_loss:.5f}  first {row['first_steps_s']} s",
        flush=True,
    )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=None, help="blocks (12; 2 with --quick)")
    ap.add_argument("--dim", type=int, default=None, help="width (1024; 32 with --quick)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (2048; 16)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (8; 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (10; 2)")
    ap.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="autocast dtype (bf16 on a GPU; fp32, no autocast, on a CPU)",
    )
    ap.add_argument("--compile-backend", default=None, help="inductor (aot_eager on a CPU)")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; choose from {', '.join(VARIANTS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    q = args.quick
    cfg = {
        "layers": args.layers or (2 if q else 12),
        "dim": args.dim or (32 if q else 1024),
        "heads": 2 if q else 16,
        "seq": args.seq or (16 if q else 2048),
        "batch": args.batch or (2 if q else 8),
        "vocab": 64 if q else 8192,
    }
    steps = args.steps or (2 if q else 10)
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[dtype]
    backend = args.compile_backend or ("inductor" if device == "cuda" else "aot_eager")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    init = MHCTransformer(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], 4, HyperConnection)
    state = {k: v.to(device) for k, v in init.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen)
    data = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    print(f"config {cfg}, {steps} timed steps, autocast {dtype}, compile backend {backend}")
    rows = []
    name, gpu = mhc_results.device_name(device)
    res = {
        "device": name,
        "torch": torch.__version__,
        "config": cfg,
        "autocast": dtype,
        "compile_backend": backend,
        "rows": rows,
    }
    out_name = f"mhc_train_{gpu}{'_quick' if q else ''}"
    for v in variants:
        try:
            rows.append(run_variant(v, cfg, device, amp, state, data, steps, 2, backend))
        except Exception as e:  # noqa: BLE001 - a failing variant must not end the run
            print(f"{v}: FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
            rows.append({"variant": v, "error": f"{type(e).__name__}: {e}"[:2000]})
        if device == "cuda":
            torch.cuda.empty_cache()
        # after every variant: a run stopped by a time limit (compiling the reference takes
        # minutes) keeps the rows it measured
        mhc_results.write(res, args.out, out_name)
    by = {r["variant"]: r for r in rows if "error" not in r}
    if "ours-eager" in by and "ours-compiled" in by:
        ratio = by["ours-eager"]["ms_per_step"] / by["ours-compiled"]["ms_per_step"]
        print(f"ours: compiled step {ratio:.2f}x as fast as eager")
    for mode in ("eager", "compiled"):
        a, b = by.get(f"ours-{mode}"), by.get(f"reference-{mode}")
        if a and b:
            print(
                f"{mode}: ours {b['ms_per_step'] / a['ms_per_step']:.2f}x as fast as the "
                f"reference, peak {a['peak_gib']} vs {b['peak_gib']} GiB"
            )


if __name__ == "__main__":
    main()
