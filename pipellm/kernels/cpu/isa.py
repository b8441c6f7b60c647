"""The x86 instruction-set levels the C++ CPU kernels are built for, and which one runs.

One build holds every level's variant of the ISA-specific kernels (the block GEMMs); at run
time the best level the CPU reports is chosen, or a lower one when `PIPELLM_CPU_ISA` /
`--cpu-isa` asks for it (so an AVX-512 machine runs and tests the AVX2 path). Levels, lowest
first; each includes the ones before it:

    avx2         AVX2 + FMA + F16C (x86-64-v3): every x86 CPU since Haswell / Zen 1; the floor
                 the whole extension is compiled for (below it the PyTorch reference runs)
    avx512       AVX-512 F/BW/VL/DQ (x86-64-v4): Skylake-SP and later, Zen 4 and later
    avx512_vnni  + VNNI (vpdpbusd: int8 dot products in one instruction)
    amx          + AMX tiles with BF16 (Sapphire Rapids and later): the block GEMMs run their
                 avx512_vnni variant, and a step with many rows runs its quantized layers as
                 bf16 GEMMs in oneDNN, which uses the tiles
                 (pipellm/services/compute/model/linear/amx.py)

The C++ block GEMMs have a variant for each of the first three (`BLOCK_GEMM_LEVELS`), and at the
avx2 level a second one for CPUs with AVX-VNNI (the 256-bit vpdpbusd of Alder Lake, Sierra
Forest and Zen 5, which need not have AVX-512): `avx2_vnni`, which the avx2 level runs where the
CPU has it (`VARIANTS`). On other architectures (ARM) no level applies: the block GEMMs fall back
to PyTorch, and the rest of the extension is compiled for the architecture's baseline.
"""

from __future__ import annotations

import os
import platform

LEVELS = ("avx2", "avx512", "avx512_vnni", "amx")
BLOCK_GEMM_LEVELS = LEVELS[:3]  # the levels with a C++ block GEMM variant
VARIANTS = ("avx2", "avx2_vnni", *BLOCK_GEMM_LEVELS[1:])  # the block GEMMs' variants
# the features (torch.cpu.get_capabilities' names) each level needs on top of the previous one
_NEEDS = {
    "avx2": ("avx", "avx2", "fma3", "f16c", "bmi2"),
    "avx512": ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"),
    "avx512_vnni": ("avx512_vnni",),
    "amx": ("amx_tile", "amx_bf16", "avx512_bf16"),
}
CHOICES = ("auto", *LEVELS)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def cpu_flags() -> frozenset[str]:
    """The features the CPU and the OS support, as PyTorch's cpuinfo reports them ('avx2',
    'avx512_vnni', 'amx_int8', ...)."""
    import torch

    return frozenset(k for k, v in torch.cpu.get_capabilities().items() if v is True)


def int8_dot_products(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has VNNI (AVX-512 or AVX), which oneDNN's INT8 GEMMs (`torch._int_mm`)
    need to be fast."""
    return bool({"avx512_vnni", "avx_vnni"} & (cpu_flags() if flags is None else flags))


def cpu_levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The levels this CPU runs, lowest first (empty: not x86, or below AVX2)."""
    flags = cpu_flags() if flags is None else flags
    levels: list[str] = []
    for level in LEVELS:
        if not set(_NEEDS[level]) <= flags:
            break
        levels.append(level)
    return tuple(levels)


def choose(requested: str, levels: tuple[str, ...]) -> str | None:
    """The level to run: the best of `levels` for "auto", else `requested` if the CPU runs it.
    None when the CPU runs no level. ValueError for an unknown name or one above the CPU's."""
    if requested not in CHOICES:
        raise ValueError(f"PIPELLM_CPU_ISA / --cpu-isa must be one of {', '.join(CHOICES)}, "
                         f"not {requested!r}")
    if requested == "auto":
        return levels[-1] if levels else None
    if requested not in levels:
        best = levels[-1] if levels else "none (below AVX2, or not x86)"
        raise ValueError(f"--cpu-isa {requested}: this CPU's best level is {best}")
    return requested


_requested = os.environ.get("PIPELLM_CPU_ISA", "auto") or "auto"


def block_gemm_level(level: str | None, flags: frozenset[str] | None = None) -> str | None:
    """The block GEMM variant `level` runs: the highest of BLOCK_GEMM_LEVELS not above it, at
    avx2 its AVX-VNNI variant where the CPU (its `flags`) has that."""
    if not level:
        return None
    variant = BLOCK_GEMM_LEVELS[min(LEVELS.index(level), len(BLOCK_GEMM_LEVELS) - 1)]
    if variant == "avx2" and "avx_vnni" in (cpu_flags() if flags is None else flags):
        return "avx2_vnni"
    return variant


def variants(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The block GEMM variants this CPU runs (each can be switched on in process)."""
    flags = cpu_flags() if flags is None else flags
    levels = cpu_levels(flags)
    return tuple(v for v in VARIANTS if v in levels or (
        v == "avx2_vnni" and "avx2" in levels and "avx_vnni" in flags))


def set_level(requested: str) -> None:
    """Ask for a level (`--cpu-isa`), checked against the CPU at once; before the first call
    into the kernels, which fixes it for the process."""
    global _requested
    choose(requested, cpu_levels())
    _requested = requested


def selected() -> str | None:
    """The level the kernels run (None: no level applies; the extension is then not loaded on
    x86, and on ARM its block GEMMs fall back to PyTorch)."""
    return choose(_requested, cpu_levels())


def native_bf16() -> bool:
    """Whether the selected level computes in bfloat16 natively (AVX512-BF16 at the avx512
    level or above): where a GGUF model runs its activations and KV cache in bfloat16."""
    return selected() not in (None, "avx2") and "avx512_bf16" in cpu_flags()


def describe() -> str:
    """One line for banners and benchmarks: 'amx (CPU: avx2 avx512 avx512_vnni amx)'."""
    has = cpu_levels()
    if not is_x86():
        return f"{platform.machine()} (no x86 level: the block GEMMs run in PyTorch)"
    try:
        level = selected()
    except ValueError as exc:
        level = f"invalid ({exc})"
    forced = "" if _requested == "auto" else ", forced"
    vnni = " +avx_vnni" if "avx_vnni" in cpu_flags() and has else ""
    return f"{level or 'none'}{forced} (CPU: {' '.join(has) or 'below avx2'}{vnni})"
