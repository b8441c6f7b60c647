"""LoRA adapters as GGUF files (llama.cpp's convert_lora_to_gguf.py format): PEFT adapters of a
tiny random Llama written here as that converter writes them (lora_a [r, in], lora_b [out, r],
q/k lora_b rows permuted as llama.cpp permutes the base's q/k), served token-exact against
PEFT's `merge_and_unload()` over a GGUF base and over the HF base; F16, BF16 and Q8_0 files;
rsLoRA (only alpha in GGUF); files that are no adapter, and ranks over --max-lora-rank, refused.

Two random PEFT adapters: A is rank 8 on every projection; B rank 16 with rsLoRA on q, k and
down only.
"""

from __future__ import annotations

import math
import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V
from gguf import GGUFWriter, QuantError
from gguf.quants import dequantize

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.lora.weights import fuse, read_factors
from pipellm.shared.config import EngineConfig
from pipellm.shared.lora import GGUF_TARGETS, AdapterConfig, LoraError, LoraModule
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.settings import with_settings
from tests.gguf_files import Q, permute, quantized, write_gguf
from tests.test_engine_vs_hf import hf_greedy, make_prompts
from tests.test_lora import ALL, MAX_NEW, build_adapter, lora_engine, run

ADAPTERS = {  # name -> (rank, alpha, use_rslora, target modules, seed)
    "A": (8, 16, False, ALL, 1),
    "B": (16, 8, True, ["q_proj", "k_proj", "down_proj"], 2),
}
_PEFT = re.compile(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$")


def gguf_lora_tensors(adapter_dir, hf_config, arch: str = "llama") -> dict[str, np.ndarray]:
    """The factors of the PEFT adapter at `adapter_dir` under llama.cpp's names, as
    convert_lora_to_gguf.py writes them: lora_a = lora_A [r, in], lora_b = lora_B [out, r],
    for `llama` the q/k lora_b rows permuted per head (q: attention heads, k: KV heads)."""
    from safetensors.numpy import load_file

    short = {peft: name for name, peft in GGUF_TARGETS.items()}
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    out = {}
    for name, t in load_file(adapter_dir / "adapter_model.safetensors").items():
        layer, module, factor = _PEFT.search(name).groups()
        if factor == "B" and arch == "llama" and module in heads:
            t = permute(t, heads[module])
        out[f"blk.{layer}.{short[module]}.weight.lora_{factor.lower()}"] = t
    return out


def write_gguf_adapter(path, tensors: dict[str, np.ndarray], qtype=Q.F32, *,
                       alpha: float | None = 16.0, arch: str = "llama", meta: dict | None = None):
    """A GGUF LoRA file of `tensors` as the converter writes it: general.type "adapter",
    adapter.type "lora", adapter.lora.alpha (None: left out), tensors in `qtype` (Q8_0 falls
    back to F16 for rows of a size it cannot block, as the converter does)."""
    w = GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for key, value in (meta or {}).items():
        w.add_key_value(key, *value)
    w.add_quantization_version(2)
    for name, t in tensors.items():
        data, raw_dtype = _stored(t, qtype)
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stored(t: np.ndarray, qtype):
    """(data, raw_dtype) GGUFWriter.add_tensor takes for `t` in `qtype`."""
    if qtype == Q.F32:
        return t.astype(np.float32), None
    try:
        data = quantized(t, qtype)
    except QuantError:  # the converter's fallback
        return t.astype(np.float16), None
    return data, None if qtype == Q.F16 else qtype


def stored_values(t: torch.Tensor, qtype) -> torch.Tensor:
    """`t` as a GGUF file of `qtype` stores it, back in float32."""
    data, raw = _stored(t.numpy(), qtype)
    if raw is None:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(np.asarray(dequantize(data, raw), np.float32).reshape(t.shape))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF base model, its dir, its F32 GGUF file, {adapter: PEFT dir}, {adapter: GGUF file,
    written as the converter would}, {"" and each adapter: PEFT's greedy tokens}, prompts)."""
    from tests.hf_models import build_hf_model

    root = tmp_path_factory.mktemp("lora_gguf")
    base_dir = root / "hf"
    base = build_hf_model(base_dir, "llama", with_tokenizer=True, initializer_range=0.1,
                          num_key_value_heads=2)
    prompts = [p[:40] for p in make_prompts(base.config.vocab_size, seed=3)[:6]]
    expected = {"": hf_greedy(base, prompts, MAX_NEW)}
    dirs, files = {}, {}
    for name, (rank, alpha, rslora, targets, seed) in ADAPTERS.items():
        dirs[name] = root / name
        merged = build_adapter(base_dir, dirs[name], rank, alpha, rslora, targets, seed)
        expected[name] = hf_greedy(merged, prompts, MAX_NEW)
        files[name] = write_gguf_adapter(root / f"{name}.gguf",
                                         gguf_lora_tensors(dirs[name], base.config), alpha=alpha)
    gguf_base = write_gguf(root / "base.gguf", base, Q.F32, meta={"general.type": "model"})
    return base, base_dir, gguf_base, dirs, files, expected, prompts


def test_adapter_config_from_gguf(setup, tmp_path):
    """Rank from the shapes, alpha from adapter.lora.alpha (absent or 0: alpha = rank, i.e.
    llama.cpp's scale 1), the targets present; q/k rows flagged llama.cpp's for `llama` only."""
    base, _, _, dirs, files, _, _ = setup
    a = AdapterConfig.read(files["A"])
    assert (a.rank, a.alpha, a.scaling, a.targets) == (8, 16.0, 2.0, frozenset(ALL))
    assert a.llama_qk_rows and not a.use_rslora
    assert AdapterConfig.read(files["B"]).targets == {"q_proj", "k_proj", "down_proj"}
    tensors = gguf_lora_tensors(dirs["A"], base.config, arch="qwen2")
    for alpha, arch in ((None, "llama"), (0.0, "llama"), (None, "qwen2")):
        path = write_gguf_adapter(tmp_path / f"{alpha}{arch}.gguf", tensors, alpha=alpha,
                                  arch=arch)
        c = AdapterConfig.read(path)
        assert (c.rank, c.scaling, c.llama_qk_rows) == (8, 1.0, arch == "llama")


def test_rslora_is_not_expressible_in_gguf(setup):
    """GGUF holds alpha only, applied as alpha / r (llama.cpp's rule): B (rsLoRA, alpha 8,
    rank 16) converted as is scales by 0.5, not PEFT's 8 / sqrt(16) = 2."""
    _, _, _, dirs, files, _, _ = setup
    peft, gguf = AdapterConfig.read(dirs["B"]), AdapterConfig.read(files["B"])
    assert (peft.use_rslora, peft.scaling) == (True, 2.0)
    assert (gguf.use_rslora, gguf.alpha, gguf.scaling) == (False, 8.0, 0.5)


def test_factors_in_peft_order(setup):
    """read_factors of the GGUF file: PEFT's A and B, but for the q/k B rows (llama.cpp's
    order); fused, every projection of every layer equals PEFT's."""
    base, base_dir, _, dirs, files, _, _ = setup
    cfg = ModelConfig.from_path(base_dir)
    for name in ADAPTERS:
        peft, gguf = read_factors(dirs[name]), read_factors(files[name])
        assert peft.keys() == gguf.keys()
        for (layer, module), f in peft.items():
            assert torch.equal(gguf[layer, module]["A"], f["A"])
            assert torch.equal(gguf[layer, module]["B"], f["B"]) == (
                module not in ("q_proj", "k_proj"))
        configs = AdapterConfig.read(dirs[name]), AdapterConfig.read(files[name])
        for layer in range(cfg.num_layers):
            for p in ("qkv", "o", "gate_up", "down"):
                want = fuse(peft, configs[0], cfg, layer, p, torch.float32)
                got = fuse(gguf, configs[1], cfg, layer, p, torch.float32)
                assert (want is None) == (got is None)
                if want is not None:
                    assert torch.equal(got[0], want[0])
                    torch.testing.assert_close(got[1] * configs[0].scaling / configs[1].scaling,
                                               want[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("base_kind", ["gguf", "hf"])
def test_gguf_adapters_match_peft_merged(setup, tmp_path, base_kind):
    """A from --lora-modules, B loaded at run time (its file written with alpha 8 * sqrt(16),
    rsLoRA's scale as plain alpha): every request of a batch mixing the base, A and B gets
    PEFT's merged tokens, over the F32 GGUF base and over the HF base."""
    base, base_dir, gguf_base, dirs, files, expected, prompts = setup
    b_file = write_gguf_adapter(tmp_path / "B.gguf", gguf_lora_tensors(dirs["B"], base.config),
                                alpha=8 * math.sqrt(16))
    model = gguf_base if base_kind == "gguf" else base_dir
    engine = lora_engine(model, {"A": files["A"]}, max_loras=2)
    engine.adapters.load(LoraModule("B", str(b_file)))
    names = ["", "A", "B"]
    requests = [(p, names[(i + k) % 3]) for k in range(3) for i, p in enumerate(prompts)]
    got = run(engine, requests, arrive_every=2)
    for (prompt, name), out in zip(requests, got, strict=True):
        assert out == expected[name][prompts.index(prompt)], (name, prompts.index(prompt))
    converted = lora_engine(model, {"B": files["B"]})  # alpha as is: not PEFT's rsLoRA
    assert run(converted, [(p, "B") for p in prompts]) != expected["B"]


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0], ids=lambda q: q.name)
def test_low_precision_adapter_files(setup, tmp_path, qtype):
    """An adapter file of F16, BF16 or Q8_0 (lora_b F16: rank 8 rows are not whole Q8_0
    blocks) serves PEFT's merged tokens of the factors as the file stores them."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    base, base_dir, gguf_base, dirs, _, _, prompts = setup
    rounded = tmp_path / "peft"
    shutil.copytree(dirs["A"], rounded)
    weights = load_file(rounded / "adapter_model.safetensors")
    save_file({n: stored_values(t, qtype) for n, t in weights.items()},
              rounded / "adapter_model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(hf, rounded).merge_and_unload().eval()
    want = hf_greedy(merged, prompts, MAX_NEW)
    path = write_gguf_adapter(tmp_path / "A.gguf", gguf_lora_tensors(dirs["A"], base.config),
                              qtype)
    factors, peft = read_factors(path), read_factors(rounded)
    assert torch.equal(factors[0, "o_proj"]["A"], peft[0, "o_proj"]["A"])
    assert not torch.equal(factors[0, "o_proj"]["A"], read_factors(dirs["A"])[0, "o_proj"]["A"])
    engine = lora_engine(gguf_base, {"A": path})
    assert run(engine, [(p, "A") for p in prompts]) == want


def test_gguf_file_that_is_no_adapter_is_refused(setup, tmp_path):
    """A GGUF base given as an adapter: a clear LoraError at start-up and at run time, nothing
    of it attached; a file neither GGUF nor a directory too."""
    _, base_dir, gguf_base, _, files, _, _ = setup
    with pytest.raises(LoraError, match="not a LoRA adapter.*general.type 'model'"):
        AdapterConfig.read(gguf_base)
    with pytest.raises(LoraError, match="not a LoRA adapter"):
        read_factors(gguf_base)
    with pytest.raises(LoraError, match="not a LoRA adapter"):
        with_settings(EngineConfig(), model=str(base_dir), enable_lora=True,
                      lora_modules=f"X={gguf_base}")
    engine = lora_engine(base_dir, {"A": files["A"]}, max_loras=2)
    with pytest.raises(LoraError, match="not a LoRA adapter"):
        engine.adapters.load(LoraModule("X", str(gguf_base)))
    assert engine.adapters.names == {"A"}
    text = tmp_path / "notes.txt"
    text.write_text("not an adapter")
    with pytest.raises(LoraError, match="neither a PEFT directory nor a GGUF file"):
        AdapterConfig.read(text)


def test_malformed_adapter_files_are_refused(setup, tmp_path):
    """Ranks that differ, a lora_a without its lora_b, a norm, an aLoRA, an unknown
    architecture: each a LoraError naming what is wrong."""
    base, _, _, dirs, _, _, _ = setup
    good = gguf_lora_tensors(dirs["A"], base.config)
    cases = {
        "ranks": ({**good, "blk.1.ffn_up.weight.lora_a": good["blk.1.ffn_up.weight.lora_a"][:4],
                   "blk.1.ffn_up.weight.lora_b": good["blk.1.ffn_up.weight.lora_b"][:, :4]},
                  {}, "ranks \\[4, 8\\]"),
        "pair": ({n: t for n, t in good.items() if n != "blk.0.attn_v.weight.lora_b"}, {},
                 "layer 0 v_proj has lora_a without its pair"),
        "norm": ({**good, "blk.0.attn_norm.weight": np.ones(64, np.float32)}, {},
                 "blk.0.attn_norm.weight is not a factor"),
        "alora": (good, {"adapter.alora.invocation_tokens": ([5, 6], V.ARRAY, V.UINT32)},
                  "aLoRA"),
    }
    for case, (tensors, meta, message) in cases.items():
        path = write_gguf_adapter(tmp_path / f"{case}.gguf", tensors, meta=meta)
        with pytest.raises(LoraError, match=message):
            AdapterConfig.read(path)  # all but a missing pair: that is the factors'
            read_factors(path)
    path = write_gguf_adapter(tmp_path / "mamba.gguf", good, arch="mamba")
    with pytest.raises(LoraError, match="architecture 'mamba' is not supported"):
        AdapterConfig.read(path)


def test_rank_over_max_is_refused(setup):
    """B's file (rank 16) over --max-lora-rank 8: refused at start-up and at run time."""
    _, base_dir, _, _, files, _, _ = setup
    with pytest.raises(LoraError, match="rank 16, over --max-lora-rank 8"):
        with_settings(EngineConfig(), model=str(base_dir), enable_lora=True, max_loras=2,
                      lora_modules=f"A={files['A']} B={files['B']}", max_lora_rank=8)
    config = with_settings(EngineConfig(), model=str(base_dir), device="cpu", dtype="float32",
                           enable_lora=True, max_loras=2, lora_modules=f"A={files['A']}",
                           max_lora_rank=8)
    engine = build_engine(config)
    with pytest.raises(LoraError, match="rank 16, over --max-lora-rank 8"):
        engine.adapters.load(LoraModule("B", str(files["B"])))
    assert engine.adapters.names == {"A"}
