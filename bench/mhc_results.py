"""The device's name and the JSON file of the hyper-connection benchmarks (bench_mhc*.py)."""

from __future__ import annotations

import json
import os
import re

import torch


def device_name(device: str) -> tuple[str, str]:
    """(torch's name of the device, its short tag for file names: h100, h200, ..., cpu)."""
    if device != "cuda":
        return "cpu", "cpu"
    name = torch.cuda.get_device_name()
    m = re.search(r"(H100|H200|A100|L40S|B200|GH200)", name)
    return name, m.group(1).lower() if m else re.sub(r"\W+", "_", name).lower()


def write(res: dict, out: str | None, stem: str) -> None:
    """Writes ``res`` to ``<out>/<stem>.json`` (``out`` None: bench/results)."""
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)
