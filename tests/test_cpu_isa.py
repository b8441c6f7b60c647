"""The ISA levels of the C++ CPU kernels (pipellm/kernels/cpu/isa.py): which levels a CPU runs, the
choice (auto, forced lower, refused above the CPU), and the block GEMMs' variants this CPU runs
giving the same bits (so `--cpu-isa avx2` serves the same tokens as the CPU's best)."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels.cpu import extension, isa
from pipellm.kernels.int4_cpu import pack_int4_blocks
from pipellm.kernels.int4_gemm import int4_gemm
from pipellm.kernels.int4_weight import quantize_int4
from pipellm.kernels.q8_gemm import pack_q8_blocks, q8_gemm, quantize_q8
from pipellm.shared.config import EngineConfig

AVX2 = frozenset({"avx", "avx2", "fma3", "f16c", "bmi2"})
AVX512 = AVX2 | {"avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"}


def test_levels_follow_the_cpu_flags():
    assert isa.cpu_levels(frozenset({"avx", "sse4_2"})) == ()
    assert isa.cpu_levels(AVX2) == ("avx2",)
    assert isa.cpu_levels(AVX512) == ("avx2", "avx512")
    vnni = AVX512 | {"avx512_vnni"}
    assert isa.cpu_levels(vnni | {"amx_int8"}) == isa.BLOCK_GEMM_LEVELS  # tiles without bf16
    assert isa.cpu_levels(vnni | {"amx_tile", "amx_bf16", "avx512_bf16"}) == isa.LEVELS
    assert isa.cpu_levels(AVX2 | {"avx512_vnni"}) == ("avx2",)  # levels build on each other


def test_each_level_runs_the_block_gemm_variant_at_or_below_it():
    assert [isa.block_gemm_level(lv, AVX512) for lv in isa.LEVELS] == [
        "avx2", "avx512", "avx512_vnni", "avx512_vnni"]
    assert isa.block_gemm_level(None) is None
    # AVX-VNNI (an Alder Lake, a Sierra Forest, a Zen 5) gives the avx2 level its dot products
    assert isa.block_gemm_level("avx2", AVX2 | {"avx_vnni"}) == "avx2_vnni"
    assert isa.block_gemm_level("avx512", AVX512 | {"avx_vnni"}) == "avx512"
    assert isa.variants(AVX2) == ("avx2",)
    assert isa.variants(AVX2 | {"avx_vnni"}) == ("avx2", "avx2_vnni")
    assert isa.variants(AVX512 | {"avx512_vnni"}) == ("avx2", "avx512", "avx512_vnni")


def test_choice_auto_forced_and_refused():
    assert isa.choose("auto", ("avx2", "avx512")) == "avx512"
    assert isa.choose("auto", ()) is None
    assert isa.choose("avx2", ("avx2", "avx512")) == "avx2"
    with pytest.raises(ValueError, match="best level is avx2"):
        isa.choose("avx512_vnni", ("avx2",))
    with pytest.raises(ValueError, match="must be one of"):
        isa.choose("sse2", isa.LEVELS)


def test_config_refuses_a_level_this_cpu_lacks():
    with pytest.raises(ValueError, match="--cpu-isa"):
        EngineConfig(cpu_isa="avx9")
    above = next((lv for lv in isa.LEVELS if lv not in isa.cpu_levels()), None)
    if above is not None:
        with pytest.raises(ValueError, match="best level"):
            EngineConfig(cpu_isa=above)
    for level in isa.cpu_levels():
        assert EngineConfig(cpu_isa=level).cpu_isa == level


def test_describe_names_the_level_and_the_cpu(monkeypatch):
    if not isa.cpu_levels():
        pytest.skip(f"no x86 level on this CPU: {isa.describe()}")
    monkeypatch.setattr(isa, "_requested", "avx2")
    assert isa.describe().startswith("avx2, forced (CPU: avx2")
    monkeypatch.setattr(isa, "_requested", "auto")
    assert isa.describe().startswith(f"{isa.cpu_levels()[-1]} (CPU: ")


def test_every_variant_gives_the_same_bits():
    ext = extension()
    if ext is None or not ext.block_gemm_isa() or len(isa.variants()) < 2:
        pytest.skip(f"fewer than two block-GEMM variants run here ({isa.describe()})")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 576, generator=g) * 0.05  # N % 16 = 8: a half tile
    x = torch.randn(37, 576, generator=g)
    q4, q8 = pack_int4_blocks(quantize_int4(w, 32)), pack_q8_blocks(quantize_q8(w))
    previous, outs = ext.block_gemm_isa(), {}
    try:
        for variant in isa.variants():
            ext.set_block_gemm_isa(variant)
            outs[variant] = (int4_gemm(x, q4), q8_gemm(x, q8))
    finally:
        ext.set_block_gemm_isa(previous)
    first = outs["avx2"]
    for variant, (o4, o8) in outs.items():
        assert torch.equal(o4, first[0]) and torch.equal(o8, first[1]), variant


def test_native_bf16_needs_the_flag_and_a_level_above_avx2(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: AVX512 | {"avx512_bf16"})
    for level, native in (("avx2", False), ("avx512", True), (None, False)):
        monkeypatch.setattr(isa, "selected", lambda level=level: level)
        assert isa.native_bf16() is native, level
    monkeypatch.setattr(isa, "cpu_flags", lambda: AVX512)
    assert not isa.native_bf16()


def test_auto_dtype_of_a_gguf_is_bfloat16_where_the_cpu_computes_in_it(monkeypatch, tmp_path):
    from pipellm.services.compute.runner import resolve_dtype
    from pipellm.shared.model_config import ModelConfig
    from tests.gguf_files import Q, write_gguf
    from tests.hf_models import build_hf_model

    hf = tmp_path / "hf"
    gguf = write_gguf(tmp_path / "m.gguf", build_hf_model(hf, "llama"), Q.Q4_1)
    cfg = ModelConfig.from_path(str(gguf))  # float32: a GGUF file names no dtype
    cpu = torch.device("cpu")
    monkeypatch.setattr(isa, "native_bf16", lambda: True)
    assert resolve_dtype("auto", cfg, str(gguf), cpu) == torch.bfloat16
    assert resolve_dtype("float32", cfg, str(gguf), cpu) == torch.float32
    assert resolve_dtype("auto", cfg, str(hf), cpu) == torch.float32  # the checkpoint's own
    assert resolve_dtype("auto", cfg, str(gguf), torch.device("cuda")) == torch.float32
    monkeypatch.setattr(isa, "native_bf16", lambda: False)
    assert resolve_dtype("auto", cfg, str(gguf), cpu) == torch.float32


def test_the_engine_runs_at_every_variant(tmp_path):
    """A 4-bit GGUF model served in process at each block GEMM variant this CPU runs: every
    kernel the step dispatches by the chosen level (GEMMs, prefill and decode attention, norms,
    activations) takes each variant, and variants of one vector width give the same tokens and
    logprobs."""
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.sampling import SamplingParams
    from pipellm.shared.settings import with_settings
    from tests.gguf_files import Q, write_gguf
    from tests.hf_models import build_hf_model

    ext = extension()
    if ext is None or not ext.block_gemm_isa():
        pytest.skip(f"the C++ block GEMMs do not run here ({isa.describe()})")
    gguf = write_gguf(tmp_path / "m.gguf", build_hf_model(tmp_path / "hf", "llama"), Q.Q4_1)
    engine = build_engine(with_settings(EngineConfig(), model=str(gguf), device="cpu",
                                        dtype="float32", max_model_len=256,
                                        kv_cache_tokens=2048))
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 40, 90))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    previous, outs = ext.block_gemm_isa(), {}
    try:
        for variant in isa.variants():
            ext.set_block_gemm_isa(variant)
            seqs = engine.generate(prompts, params)
            outs[variant] = [(s.output_ids, s.logprobs) for s in seqs]
    finally:
        ext.set_block_gemm_isa(previous)
    assert all(len(ids) == 12 for out in outs.values() for ids, _ in out)
    for a, b in (("avx2", "avx2_vnni"), ("avx512", "avx512_vnni")):
        if a in outs and b in outs:
            assert outs[a] == outs[b], (a, b)
