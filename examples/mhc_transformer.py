"""A small causal transformer whose residual stream is widened to n streams with mHC.

Each block has two hyper-connected sub-layers (attention, MLP). The token embedding is copied
into the n streams, and the streams are averaged before the output head. Trains on a copy
task; the torch path on the CPU, the fused Triton kernels on CUDA:

    python examples/mhc_transformer.py            # 20 steps, dim 64, seq 32, batch 8
    python examples/mhc_transformer.py --quick    # 5 steps, dim 32, seq 16, batch 4

Measured on a shared 2-core CPU (load average 3–6 from other jobs), whole command:
``--quick`` (one torch thread) 5.1 s; the defaults 3.7 s with ``--threads 1``, 11 s with
torch's default two threads. The CPU run needs no Triton (``flashsinkhorn.mhc`` imports its
kernels on first use on CUDA).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from flashsinkhorn.mhc import HyperConnection

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, n_streams: int, **hc_kw):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.hc_attn = HyperConnection(dim, n_streams, **hc_kw)
        self.hc_mlp = HyperConnection(dim, n_streams, **hc_kw)

    def _attend(self, u: torch.Tensor) -> torch.Tensor:
        h = self.norm1(u)
        mask = nn.Transformer.generate_square_subsequent_mask(u.shape[1], device=u.device)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        # streams: (batch, seq, n, dim)
        streams = self.hc_attn(streams, self._attend)
        return self.hc_mlp(streams, lambda u: self.mlp(self.norm2(u)))


class TinyMHCTransformer(nn.Module):
    def __init__(self, vocab=64, dim=64, heads=4, layers=2, n_streams=4, **hc_kw):
        super().__init__()
        self.n_streams = n_streams
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, n_streams, **hc_kw) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (batch, seq, dim)
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.n_streams, x.shape[-1])
        for block in self.blocks:
            streams = block(streams)
        return self.head(self.norm(streams.mean(-2)))


def main(steps=20, dim=64, seq=32, batch=8, layers=2, verbose=True):
    """Trains on a copy task for a few steps; returns the losses."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyMHCTransformer(dim=dim, layers=layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, 64, (batch, seq), device=device)
        logits = model(tokens[:, :-1])
        # predict the previous token (learnable through the causal attention)
        loss = nn.functional.cross_entropy(
            logits[:, 1:].reshape(-1, 64), tokens[:, :-2].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if verbose and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}")
    return losses


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (20; 5 with --quick)")
    p.add_argument("--dim", type=int, default=None, help="model width (64; 32 with --quick)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (32; 16 with --quick)")
    p.add_argument("--batch", type=int, default=None, help="batch size (8; 4 with --quick)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds on a CPU")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    args = p.parse_args()
    q = args.quick
    set_threads(args.threads, q)
    main(
        steps=args.steps or (5 if q else 20),
        dim=args.dim or (32 if q else 64),
        seq=args.seq or (16 if q else 32),
        batch=args.batch or (4 if q else 8),
        layers=args.layers,
    )


if __name__ == "__main__":
    cli()
