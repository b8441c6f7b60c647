"""Gemma 3 and Gemma 2 beyond the engine-vs-transformers checks they share with the other
architectures (tests/test_architectures.py's variants gemma3, gemma2): the config layouts the
Hub ships, RoPE scaled on the full layers only, quantization, the configs we refuse, and a
Gemma 3 GGUF file served through the real services to the official client.
"""

from __future__ import annotations

import json

import pytest

from pipellm.shared.model_config import ModelConfig, ModelLoadError
from tests.gguf_files import Q, write_gguf
from tests.hf_models import build_hf_model
from tests.test_architectures import TINY, engine, greedy, random_prompts
from tests.test_engine_vs_hf import hf_greedy


def test_gemma3_v4_config_layout(tmp_path):
    """A Gemma 3 config.json as the Hub ships it (transformers v4: rope_theta, rope_scaling of
    the full layers, rope_local_base_freq, sliding_window_pattern; no layer_types) reads as
    the v5 layout does."""
    build_hf_model(tmp_path, "gemma3", num_hidden_layers=7, layer_types=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key)
    cfg |= {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "rope_local_base_freq": 5000.0, "sliding_window_pattern": 3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_dir(tmp_path)
    assert (mc.rope_theta, mc.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert mc.local_rope_theta == 5000.0 and mc.attention_scale == 32**-0.5
    assert [mc.layer_window(i) for i in range(7)] == [16, 16, 0, 16, 16, 0, 16]
    assert (mc.attn_softcap, mc.final_softcap, mc.embed_scale) == (0.0, 0.0, 8.0)


def test_gemma3_scales_rope_on_its_full_layers_only(tmp_path):
    """Gemma 3 4B+: linear RoPE scaling (factor 8) on the full layers, the sliding layers'
    base unscaled: tokens as transformers'."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    model = build_hf_model(tmp_path, "gemma3", **TINY, rope_parameters=rope)
    prompts = random_prompts([3, 40, 120])
    seqs = engine(tmp_path, max_batched_tokens=64, max_running=4,
                  kv_cache_tokens=1024).generate(prompts, greedy(16))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, 16)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for Gemma"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope type 'linear' on the sliding layers"),
])
def test_unservable_gemma_configs_name_the_field(tmp_path, changes, needle):
    build_hf_model(tmp_path, "gemma3", num_hidden_layers=1, layer_types=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ModelLoadError, match=needle):
        ModelConfig.from_dir(tmp_path)


def test_gemma3_quantized_scores_text_like_the_float_model(tmp_path):
    """INT4 (requantized from float: 0.03), W8A8 (SmoothQuant folds into the MLP's input norm,
    pre_feedforward_layernorm, and GELU-tanh's rows are quantized after it) and FP8:
    perplexity as tests/test_quantization.py holds dense models to it."""
    from tests.test_quantization import TOLERANCE, _engine, _perplexity

    build_hf_model(tmp_path, "gemma3", **TINY)
    ref = _perplexity(_engine(tmp_path, quantization="none"))
    for method, tolerance in {**TOLERANCE, "int4": 0.03}.items():
        got = _perplexity(_engine(tmp_path, quantization=method))
        assert abs(got / ref - 1) <= tolerance and got != ref, (method, got, ref)


def test_gemma3_gguf_through_the_services_with_the_official_client(tmp_path):
    """`pipellm up` on a Gemma 3 GGUF file (real processes, real Redis): the openai client's
    greedy completion is transformers' greedy continuation of the same token ids, and a
    streamed chat equals the unstreamed one."""
    import openai

    from pipellm.shared.tokenizer import decode, encode, load_tokenizer
    from tests.stack import Stack

    model = build_hf_model(tmp_path / "hf", "gemma3", **TINY)
    gguf = write_gguf(tmp_path / "gemma3.gguf", model, Q.F32, arch="gemma3")
    tok = load_tokenizer(gguf)
    prompt = "The quick brown fox jumps over the lazy dog"
    want = decode(tok, hf_greedy(model, [encode(tok, prompt)], 12)[0])
    stack = Stack(gguf, "--served-model-name", "gemma").start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="gemma", prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == 12
        msgs = [{"role": "user", "content": "Hello there"}]
        full = client.chat.completions.create(model="gemma", messages=msgs, max_tokens=8,
                                              temperature=0, extra_body={"ignore_eos": True})
        chunks = list(client.chat.completions.create(
            model="gemma", messages=msgs, max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
            full.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    finally:
        stack.stop()


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3 4B+ ships as Gemma3ForConditionalGeneration (a vision tower beside the language
    model, text_config naming only what differs from Gemma3TextConfig's defaults): pipellm
    serves its text, token-exact with the whole model's text-only generate."""
    import transformers

    from tests.hf_models import DEFAULTS, demo_tokenizer

    tok = demo_tokenizer()
    text = {**{k: v for k, v in DEFAULTS.items() if k != "dtype"}, "head_dim": 32,
            "query_pre_attn_scalar": 32, "sliding_window": 16, "sliding_window_pattern": 2,
            "num_hidden_layers": 3, "initializer_range": 0.1, "vocab_size": tok.get_vocab_size()}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, dtype="float32",
                                       eos_token_id=tok.token_to_id("</s>"))
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    mc = ModelConfig.from_dir(tmp_path)
    assert mc.architecture == "Gemma3ForCausalLM" and mc.vocab_size == tok.get_vocab_size()
    assert [mc.layer_window(i) for i in range(3)] == [16, 0, 16]
    prompts = random_prompts([5, 50, 130])
    seqs = engine(tmp_path, max_batched_tokens=64, max_running=4,
                  kv_cache_tokens=1024).generate(prompts, greedy(12))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, 12)
