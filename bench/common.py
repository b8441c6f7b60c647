"""Helpers every benchmark script shares: progress lines, build steps and the machine it ran on."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time


def log(msg: str) -> None:
    """A timestamped progress line on stderr, with the load average (these machines are shared)."""
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr,
          flush=True)


def run_step(argv: list[str]) -> None:
    """Run a build or install step, its output on stderr; RuntimeError naming the step if it
    fails."""
    proc = subprocess.run(argv, stdout=sys.stderr, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(argv)}")


def isa() -> str:
    """The x86 level pipellm's CPU kernels run here and the CPU's levels
    (pipellm/kernels/cpu/isa.py): 'avx512_vnni (CPU: avx2 avx512 avx512_vnni amx)'."""
    from pipellm.kernels.cpu.isa import describe  # here: imports torch, which the installers lack

    return describe()


def machine() -> str:
    """CPU model, core count, ISA level, torch version and its thread count."""
    import torch  # here: the peers' installers use this module without torch

    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return (f"{cpu}, {os.cpu_count()} cores, ISA {isa()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def median_ms(fn, reps: int) -> float:
    """Median wall-clock ms of `reps` calls of fn() after one unmeasured call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
