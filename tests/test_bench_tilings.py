"""bench/kernels.py run with bench/gpu_tune.py's results: each sweep's best launch shape set
where the kernels read it, and tinygemm kept only up to the rows at which it won."""

from __future__ import annotations

import importlib
from dataclasses import asdict

from bench.kernels import apply_tilings
from pipellm.kernels.decode_attention import Tiling
from pipellm.kernels.int4_gemm import GemmTiling

# the modules (the package's names of the same spelling are its functions)
decode_attention = importlib.import_module("pipellm.kernels.decode_attention")
int4_gemm = importlib.import_module("pipellm.kernels.int4_gemm")


def test_tune_results_set_the_kernels_tilings(monkeypatch):
    monkeypatch.setattr(decode_attention, "TILINGS", dict(decode_attention.TILINGS))
    monkeypatch.setattr(int4_gemm, "TUNED", {})
    monkeypatch.setattr(int4_gemm, "TINYGEMM_ROWS", int4_gemm.TINYGEMM_ROWS)
    gemv = GemmTiling(16, 256, 64, 8, 8, fused=True)
    best = lambda tiling: {"best": {"tiling": tiling}}  # noqa: E731
    apply_tilings({"int8_decode_b64": best(asdict(Tiling(32, 4, 2))),
                   "fp8_decode_b64": best(asdict(Tiling(64, 8, 2))),
                   "w4a16_m1_4096x4096": best(asdict(gemv)),
                   "w4a16_m1_14336x4096": best("tiles"),
                   "w4a16_rows_m2_4096x4096": best("tiles"),
                   "w4a16_rows_m4_4096x4096": best("tiles"),
                   "w4a16_rows_m8_4096x4096": best(asdict(gemv)),
                   "w4a16_rows_m64_4096x4096": best("dequantize + cuBLAS"),
                   "w4a16_rows_m16_4096x4096": {"best": None}})
    assert decode_attention.TILINGS["int8"] == Tiling(32, 4, 2)
    assert decode_attention.TILINGS["fp8"] == Tiling(64, 8, 2)
    assert int4_gemm.TUNED == {(4096, 4096): gemv}  # 14336 x 4096 stays with tinygemm
    assert int4_gemm.TINYGEMM_ROWS == 4


def test_without_the_w4a16_sweep_tinygemm_keeps_its_rows(monkeypatch):
    monkeypatch.setattr(int4_gemm, "TINYGEMM_ROWS", 8)
    monkeypatch.setattr(decode_attention, "TILINGS", dict(decode_attention.TILINGS))
    apply_tilings({"decode_b1": {"best": {"tiling": asdict(Tiling(64, 4, 3, 256))}}})
    assert int4_gemm.TINYGEMM_ROWS == 8
    assert decode_attention.TILINGS["16bit"] == Tiling(64, 4, 3, 256)
