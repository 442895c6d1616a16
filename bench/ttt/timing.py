"""Timing protocol, time budgets and iteration caps, and the device's name."""

from __future__ import annotations

import re
import statistics
import subprocess
import time

#: per-iteration cost of each provider relative to our alternating iteration (for caps)
COST_FACTOR = {"ours": 1.5, "ott": 3.0, "geomloss": 10.0, "flash-sinkhorn": 1.5}


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn, device, warmups: int = 1):
    """Warm-up calls (the first one's time is ``first_call_s``), then the median wall time of
    repeated calls: at least 3, until 0.5 s of calls or 15 calls (short calls vary by ±30 %
    from one call to the next on a GPU, so 3 are too few); 1 call when one takes over 1 s.
    Returns (stats, output of the last call)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmups - 1):
        out = fn()
    times = []
    while len(times) < 15:
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if times[-1] > 1.0 or (len(times) >= 3 and sum(times) > 0.5):
            break
    stats = {
        "ms": 1e3 * statistics.median(times),
        "ms_min": 1e3 * min(times),
        "reps": len(times),
        "first_call_s": round(first, 3),
    }
    return stats, out


class Budget:
    """Deadline of one worker, and the share of it a single call may take."""

    def __init__(self, seconds: float, items: int):
        self.end = time.time() + seconds
        self.items_left = max(1, items)

    def left(self) -> float:
        return self.end - time.time()

    def call_s(self, calls_per_item: int = 4, cap: float = 5.0) -> float:
        """Seconds one call of the next item may take (shared by the items left)."""
        return max(0.2, min(cap, self.left() / self.items_left / calls_per_item))

    def done_item(self) -> None:
        self.items_left = max(1, self.items_left - 1)


def iter_cap(ref: dict, provider: str, call_s: float, lo: int = 100, hi: int = 50_000) -> int:
    """Largest iteration count that fits ``call_s`` at the reference's per-iteration time."""
    t_it = ref.get("t_iter_s") or 1e-3
    return int(min(hi, max(lo, call_s / (t_it * COST_FACTOR[provider]))))


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0].strip() or "cuda"
    except Exception:  # noqa: BLE001
        return "cuda"
