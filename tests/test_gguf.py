"""GGUF checkpoints written in the test (gguf.GGUFWriter): weights in every supported type,
tokenizer and template from metadata, the engine on them, and clear errors for what we cannot
serve."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.model.gguf_weights import load_gguf_weights
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.gguf.names import hf_name
from pipellm.shared.gguf.reader import GGUFError, GGUFFile
from pipellm.shared.model_config import ModelConfig, ModelLoadError
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import TokenizerLoadError, load_tokenizer
from tests.gguf_files import Q, RawTensor, dequantized, gguf_tensors, permute, write_gguf
from tests.hf_models import build_hf_model, demo_tokenizer

BASIC_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Worst |dequantized - original| relative to the tensor's max |value|, by type.
TOLERANCE = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1,
             Q.Q5_0: 0.07, Q.Q5_1: 0.05}
TEXTS = ["Hello there", "  leading spaces and\ttabs\n\nnewlines", "你好 🌍 ünïcödé", "x = y + 1;",
         "numbers 1234 and 5.99%", "<s>special</s> inside", ""]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random HF Llama (demo vocabulary) saved as an HF directory."""
    path = tmp_path_factory.mktemp("tiny") / "hf"
    model = build_hf_model(path, "llama", with_tokenizer=True, num_key_value_heads=2)
    return path, model


@pytest.mark.parametrize("qtype", BASIC_TYPES, ids=lambda q: q.name)
def test_weights_in_every_type_load_as_the_dequantized_reference(tmp_path, tiny, qtype):
    _, model = tiny
    path = write_gguf(tmp_path / f"m-{qtype.name}.gguf", model, qtype)
    got = load_gguf_weights(path, torch.float32, "cpu")
    want = dequantized(model, qtype)
    original = gguf_tensors(model)
    cfg = model.config
    assert len(got) == len(want)
    for name, ref in want.items():
        hf = got[hf_name(name)].numpy()
        if ".attn_q." in name:
            hf = permute(hf, cfg.num_attention_heads)  # back to the file's layout
        elif ".attn_k." in name:
            hf = permute(hf, cfg.num_key_value_heads)
        np.testing.assert_array_equal(hf, ref, err_msg=name)
        scale = np.abs(original[name]).max()
        assert np.abs(hf - original[name]).max() <= TOLERANCE[qtype] * scale + 1e-7, name


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_match_transformers_dequantization(tmp_path, tiny, name):
    """Random K-quant blocks (sane f16 scales) read back as transformers' own dequantizer does."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    qtype = Q[name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(4, 2 * nbytes), dtype=np.uint8)
    raw = _sane_f16_scales(raw, qtype)
    _, model = tiny
    tensors = {**gguf_tensors(model),
               "blk.0.ffn_gate.weight": RawTensor(raw, qtype)}
    path = write_gguf(tmp_path / "k.gguf", model, Q.F32, tensors=tensors)
    ours = GGUFFile(path).tensor("blk.0.ffn_gate.weight")
    ref = hf_dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).reshape(4, 2 * block)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=1e-6)
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0


def test_engine_on_gguf_generates_what_it_does_on_the_hf_directory(tmp_path, tiny):
    hf_dir, model = tiny
    path = write_gguf(tmp_path / "m.gguf", model, Q.F32)
    prompts = [[1, 5, 9, 200, 17], [1, 44, 3, 8], [1] + list(range(100, 140))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for model_path in (hf_dir, path):
        config = EngineConfig(model=str(model_path), kv_cache_tokens=512,
                              scheduler=SchedulerConfig(max_batched_tokens=32, max_running=8))
        outs.append([s.output_ids for s in build_engine(config).generate(prompts, params)])
    assert outs[0] == outs[1]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)
    assert outs[1][0] == hf[0, len(prompts[0]):].tolist()


def test_config_tokenizer_and_template_come_from_metadata(tmp_path, tiny):
    hf_dir, model = tiny
    path = write_gguf(tmp_path / "m.gguf", model, Q.Q8_0)
    assert ModelConfig.from_path(path) == ModelConfig.from_path(hf_dir)
    tok, ref = load_tokenizer(path), demo_tokenizer()
    for text in TEXTS:
        assert tok.encode(text).ids == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids) == ref.decode(ref.encode(text).ids)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ours = load_chat_template(path).render(messages)
    assert ours == "<s>user\nhi</s>\n<s>assistant\nhello</s>\n<s>assistant\n"


@pytest.mark.parametrize("case", ["architecture", "tokenizer", "pre", "qtype", "truncated",
                                  "garbage", "tensor"])
def test_unservable_files_fail_with_one_clear_error(tmp_path, tiny, case):
    _, model = tiny
    path = tmp_path / "bad.gguf"
    tensors = None
    meta = {"architecture": {"general.architecture": "gpt2"},
            "tokenizer": {"tokenizer.ggml.model": "bert"},
            "pre": {"tokenizer.ggml.pre": "made-up"}}.get(case)
    if case == "tensor":
        tensors = {**gguf_tensors(model), "blk.0.attn_qkv.weight": np.ones((4, 64), np.float32)}
    if case == "qtype":  # a type we do not dequantize (shape aside: the type is checked first)
        iq2 = np.ones((4, GGML_QUANT_SIZES[Q.IQ2_XXS][1]), np.uint8)
        tensors = {**gguf_tensors(model), "blk.0.ffn_up.weight": RawTensor(iq2, Q.IQ2_XXS)}
    write_gguf(path, model, Q.Q8_0, meta=meta, tensors=tensors)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    if case == "garbage":
        path.write_bytes(b"not a gguf file at all")
    expected = {"architecture": "architecture 'gpt2'", "tokenizer": "tokenizer model 'bert'",
                "pre": "pre-tokenizer 'made-up'", "qtype": "IQ2_XXS", "truncated": "truncated",
                "garbage": "not a valid GGUF", "tensor": "blk.0.attn_qkv.weight"}[case]
    out = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "up", "--model", str(path),
                          "--port", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "pipellm is up" not in out.stdout
    errors = (GGUFError, ModelLoadError, TokenizerLoadError)
    with pytest.raises(errors, match=expected.replace("(", r"\(")):
        ModelConfig.from_path(path)
        load_tokenizer(path)
        load_gguf_weights(path, torch.float32, "cpu")


def _sane_f16_scales(raw: np.ndarray, qtype) -> np.ndarray:
    """Overwrite each block's f16 super-scale(s) (the trailing or leading 2-4 bytes, by type)
    with small finite values, so random blocks dequantize to finite numbers."""
    _, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, nbytes).copy()
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q6_K):  # d (and dmin for Q2_K) at the end
        blocks[:, -2:] = scale
        if qtype == Q.Q2_K:
            blocks[:, -4:-2] = scale
    else:  # Q4_K, Q5_K: d, dmin at the start
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    return blocks.reshape(raw.shape)
