"""Helpers every benchmark script shares: progress lines and the machine it ran on."""

from __future__ import annotations

import os
import sys
import time

import torch


def log(msg: str) -> None:
    """A timestamped progress line on stderr, with the load average (these machines are shared)."""
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr,
          flush=True)


def machine() -> str:
    """CPU model, core count, torch version and its thread count."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")
