"""ModelConfig parsing and checkpoint loading, against configs saved by transformers and by hand."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pipellm.services.compute.model.weights import load_weights, require
from pipellm.shared.model_config import ModelConfig, ModelLoadError
from tests.hf_models import build_hf_model

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}
V4_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128009],
}


def write_config(path: Path, generation: dict | None = None, **changes) -> Path:
    """Write V4_LLAMA with `changes` (a None value deletes the field) to `path/config.json`."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**V4_LLAMA, **changes}
    cfg = {k: v for k, v in cfg.items() if v is not None or k not in changes}
    (path / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dir(path)
    return str(info.value)


# --- configs saved by transformers (v5 layout: rope_parameters, dtype) ------------------------


def test_llama_v5_with_llama3_rope(tmp_path):
    build_hf_model(tmp_path, "llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (512, 64, 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == LLAMA3_SCALING
    assert cfg.max_position_embeddings == 1024
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.dtype == "float32"
    assert cfg.sliding_window is None
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def test_llama_v5_default_rope_and_attention_bias(tmp_path):
    build_hf_model(tmp_path, "llama", attention_bias=True)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    assert cfg.attention_bias


def test_qwen2_bias_and_tied_embeddings(tmp_path):
    build_hf_model(tmp_path, "qwen2")
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.sliding_window is None
    assert cfg.eos_token_ids == () and cfg.bos_token_id is None


def test_qwen2_sliding_window_only_when_used(tmp_path):
    build_hf_model(
        tmp_path / "a", "qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=0
    )
    assert ModelConfig.from_dir(tmp_path / "a").sliding_window == 256
    build_hf_model(tmp_path / "b", "qwen2", use_sliding_window=False, sliding_window=256)
    assert ModelConfig.from_dir(tmp_path / "b").sliding_window is None
    build_hf_model(
        tmp_path / "c", "qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=1
    )
    cfg = ModelConfig.from_dir(tmp_path / "c")  # only layer 1 slides (tests/test_sliding_window)
    assert cfg.sliding_window == 256 and cfg.layer_types == ("full_attention", "sliding_attention")
    assert (cfg.layer_window(0), cfg.layer_window(1)) == (0, 256)


@pytest.mark.parametrize(("changes", "window", "types"), [
    ({"layer_types": None, "max_window_layers": None}, None, None),  # default 28: none of 2
    ({"layer_types": None, "max_window_layers": 1}, 64, ("full_attention", "sliding_attention")),
    ({"layer_types": ["sliding_attention"] * 2}, 64, None),
])
def test_qwen2_layer_types_as_transformers_reads_them(tmp_path, changes, window, types):
    build_hf_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=64)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **changes}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_dir(tmp_path)
    assert (mc.sliding_window, mc.layer_types) == (window, types)


@pytest.mark.parametrize("layer_types", [["sliding_attention"], ["chunked_attention"] * 2, "x"])
def test_bad_layer_types_name_the_field(tmp_path, layer_types):
    build_hf_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=64)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_types": layer_types}))
    assert "'layer_types'" in load_error(tmp_path)


def test_mistral(tmp_path):
    build_hf_model(tmp_path / "a", "mistral", sliding_window=128)
    cfg = ModelConfig.from_dir(tmp_path / "a")
    assert cfg.architecture == "MistralForCausalLM"
    assert cfg.sliding_window == 128 and not cfg.attention_bias
    build_hf_model(tmp_path / "b", "mistral", sliding_window=None)
    assert ModelConfig.from_dir(tmp_path / "b").sliding_window is None


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_mha_gqa_mqa_head_counts(tmp_path, kv_heads):
    build_hf_model(tmp_path, "llama", num_key_value_heads=kv_heads)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, kv_heads)


def test_explicit_head_dim(tmp_path):
    build_hf_model(tmp_path, "llama", head_dim=32)
    assert ModelConfig.from_dir(tmp_path).head_dim == 32


# --- hand-written v4 configs ------------------------------------------------------------------


def test_v4_config_with_generation_eos(tmp_path):
    write_config(tmp_path, generation={"eos_token_id": [128001, 128008], "bos_token_id": 128000})
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (6, 2, 16)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.dtype == "bfloat16"
    assert cfg.eos_token_ids == (128001, 128009, 128008)
    assert cfg.bos_token_id == 128000


def test_v4_defaults(tmp_path):
    write_config(
        tmp_path,
        num_key_value_heads=None,
        rope_theta=None,
        torch_dtype=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.num_kv_heads == cfg.num_heads == 6
    assert cfg.rope_theta == 10000.0 and cfg.dtype == "float32"
    assert cfg.eos_token_ids == () and cfg.bos_token_id is None


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_v4_rope_scaling(tmp_path, type_key):
    write_config(tmp_path / "linear", rope_scaling={type_key: "linear", "factor": 4.0})
    assert ModelConfig.from_dir(tmp_path / "linear").rope_scaling == {
        "rope_type": "linear",
        "factor": 4.0,
    }
    llama3 = {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}
    write_config(tmp_path / "llama3", rope_scaling={type_key: "llama3", **llama3})
    assert ModelConfig.from_dir(tmp_path / "llama3").rope_scaling == LLAMA3_SCALING


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["float32", "bfloat16", "float16"])
def test_dtype_keys(tmp_path, key, value):
    write_config(tmp_path, **{"torch_dtype": None, key: value})
    assert ModelConfig.from_dir(tmp_path).dtype == value


def test_architecture_from_model_type(tmp_path):
    write_config(tmp_path, architectures=None, model_type="mistral")
    assert ModelConfig.from_dir(tmp_path).architecture == "MistralForCausalLM"


# --- config errors ------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    message = load_error(write_config(tmp_path, architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message
    message = load_error(write_config(tmp_path, architectures=None, model_type="gpt2"))
    assert "'gpt2'" in message and "llama" in message


def test_missing_dir_and_config(tmp_path):
    assert str(tmp_path / "nope") in load_error(tmp_path / "nope")
    assert "config.json" in load_error(tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 12,')
    message = load_error(tmp_path)
    assert "config.json" in message and "not valid JSON" in message


@pytest.mark.parametrize(
    "field",
    ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"],
)
def test_missing_required_field(tmp_path, field):
    assert f"'{field}'" in load_error(write_config(tmp_path, **{field: None}))


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type(tmp_path, rope_type):
    v4 = write_config(tmp_path / "v4", rope_scaling={"type": rope_type, "factor": 2.0})
    v5 = write_config(
        tmp_path / "v5",
        rope_theta=None,
        rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0},
    )
    for path in (v4, v5):
        message = load_error(path)
        assert rope_type in message and "not supported" in message


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 4}, "num_key_value_heads (4)"),
        ({"hidden_size": 100}, "hidden_size (100)"),
        ({"torch_dtype": "int8"}, "dtype 'int8'"),
        ({"vocab_size": -3}, "'vocab_size'"),
        ({"rope_scaling": {"type": "linear"}}, "'factor'"),
    ],
)
def test_bad_field_values(tmp_path, changes, needle):
    assert needle in load_error(write_config(tmp_path, **changes))


# --- weights ------------------------------------------------------------------------------------


def test_sharded_checkpoint_matches_unsharded(tmp_path):
    model = build_hf_model(tmp_path / "single", "llama", seed=3)
    build_hf_model(tmp_path / "sharded", "llama", seed=3, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    single = load_weights(tmp_path / "single", torch.float32, "cpu")
    sharded = load_weights(tmp_path / "sharded", torch.float32, "cpu")
    expected = model.state_dict()
    assert single.keys() == sharded.keys() == expected.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]) and torch.equal(tensor, expected[name]), name


def test_unindexed_safetensors_files_and_dtype_cast(tmp_path):
    model = build_hf_model(tmp_path, "qwen2", max_shard_size="40KB")
    (tmp_path / "model.safetensors.index.json").unlink()
    weights = load_weights(tmp_path, torch.bfloat16, torch.device("cpu"))
    assert "lm_head.weight" not in weights  # tied: stored once
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    q = model.state_dict()["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert torch.equal(require(weights, "model.layers.1.self_attn.q_proj.weight"), q)


def test_weight_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_weights(tmp_path, torch.float32, "cpu")
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*convert.*safetensors"):
        load_weights(tmp_path, torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_weights(tmp_path / "nope", torch.float32, "cpu")


def test_missing_shard(tmp_path):
    build_hf_model(tmp_path, "llama", max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_weights(tmp_path, torch.float32, "cpu")


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    with pytest.raises(ModelLoadError, match="cannot read .*model.safetensors"):
        load_weights(tmp_path, torch.float32, "cpu")


def test_require_names_missing_tensor():
    weights = {"model.norm.weight": torch.ones(4)}
    assert require(weights, "model.norm.weight") is weights["model.norm.weight"]
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        require(weights, "model.layers.0.mlp.up_proj.weight")


def test_weight_loading_reports_progress_only_when_slow(caplog):
    from pipellm.services.compute.model.progress import progress

    with caplog.at_level(logging.INFO, logger="pipellm.compute"):
        assert list(progress(range(4), 4, "weights", after_s=60)) == [0, 1, 2, 3]
        assert caplog.records == []  # quick: quiet
        assert list(progress(range(4), 4, "weights", after_s=0, every_s=0)) == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("loading weights: [#####               ] 25% (1/4)")
    assert lines[3].startswith("loading weights: [####################] 100% (4/4)")
    assert lines[-1].startswith("loaded weights: 4 in")
