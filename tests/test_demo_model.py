"""The demo checkpoint: deterministic, a genuine HF Llama layout, with a byte-level tokenizer."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from pipellm.services.compute.model.weights import load_weights
from pipellm.shared.demo_model import FILES, ensure_demo_model
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.tokenizer import TokenizerLoadError, decode, encode, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "机器学习模型正在生成文本。日本語のテキストも。",
    "emoji: 🎉🚀👍🏽 and a family 👨‍👩‍👧",
]


def file_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_builds_are_byte_identical_across_processes(tmp_path, demo_model_dir):
    code = "import sys; from pathlib import Path; "
    code += "from pipellm.shared.demo_model import ensure_demo_model;"
    code += " ensure_demo_model(Path(sys.argv[1]))"
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-c", code, str(other)], cwd=REPO, check=True)
    expected = file_hashes(demo_model_dir)
    assert sorted(expected) == sorted(FILES)
    assert file_hashes(other) == expected
    assert file_hashes(ensure_demo_model(tmp_path / "third")) == expected


def test_idempotent_and_env_override(tmp_path, monkeypatch, demo_model_dir):
    monkeypatch.setenv("PIPELLM_DEMO_DIR", str(tmp_path / "from-env"))
    root = ensure_demo_model()
    assert root == tmp_path / "from-env"
    stamps = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    assert ensure_demo_model() == root
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == stamps
    assert file_hashes(root) == file_hashes(demo_model_dir)


def test_concurrent_builders_agree(tmp_path):
    root = tmp_path / "shared"
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: ensure_demo_model(root), range(4)))
    assert results == [root] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]  # no temp dirs left
    assert sorted(p.name for p in root.iterdir()) == sorted(FILES)


def test_empty_directory_is_filled_but_incomplete_one_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert sorted(p.name for p in ensure_demo_model(tmp_path / "empty").iterdir()) == sorted(FILES)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a complete demo model"):
        ensure_demo_model(tmp_path / "half")


def test_older_build_without_tokenizer_config_is_completed_in_place(tmp_path, demo_model_dir):
    old = tmp_path / "old"
    shutil.copytree(demo_model_dir, old)
    (old / "tokenizer_config.json").unlink()
    stamp = (old / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(old) == old
    assert file_hashes(old) == file_hashes(demo_model_dir)
    assert (old / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert (old / "tokenizer_config.json").stat().st_mode & 0o777 == 0o644


def test_tokenizer_config_and_chat_template_load_in_transformers(demo_model_dir):
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>",
                                                                               "<unk>")
    tok = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (1, 2, 1000)  # no added tokens
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s>system\nBe brief.</s>\n<s>user\nHi</s>\n<s>assistant\n"
    assert tok(text, add_special_tokens=False)["input_ids"][0] == 1


def test_config_matches_tokenizer(demo_model_dir):
    cfg = ModelConfig.from_dir(demo_model_dir)
    tok = load_tokenizer(demo_model_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (128, 4, 4, 2)
    assert (cfg.intermediate_size, cfg.head_dim, cfg.max_position_embeddings) == (256, 32, 2048)
    assert cfg.vocab_size == tok.get_vocab_size() == 1000
    assert cfg.bos_token_id == tok.token_to_id("<s>") == 1
    assert cfg.eos_token_ids == (tok.token_to_id("</s>"),) == (2,)
    assert tok.token_to_id("<unk>") == 0
    assert cfg.dtype == "float32" and cfg.rope_scaling is None and not cfg.tie_word_embeddings


def test_weights_are_seeded_normal_with_unit_norms(demo_model_dir):
    weights = load_weights(demo_model_dir, torch.float32, "cpu")
    assert len(weights) == 2 + 4 * 9 + 1
    assert torch.equal(weights["model.norm.weight"], torch.ones(128))
    assert torch.equal(weights["model.layers.3.input_layernorm.weight"], torch.ones(128))
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (64, 128)
    embed = weights["model.embed_tokens.weight"]
    assert embed.shape == (1000, 128)
    assert embed.std().item() == pytest.approx(0.02, rel=0.05)
    assert not torch.equal(embed, weights["lm_head.weight"])


def test_loads_in_transformers(demo_model_dir):
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        demo_model_dir, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched tensors
    weights = load_weights(demo_model_dir, torch.float32, "cpu")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    ids = encode(load_tokenizer(demo_model_dir), "Hello, world!")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 1000) and torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(demo_model_dir, text):
    tok = load_tokenizer(demo_model_dir / "tokenizer.json")
    ids = encode(tok, text)
    assert ids[0] == 1 and 1 not in ids[1:]
    assert encode(tok, text, add_special_tokens=False) == ids[1:]
    assert decode(tok, ids) == text
    assert decode(tok, ids, skip_special_tokens=False) == "<s>" + text
    assert 0 not in ids  # byte-level: never <unk>


def test_tokenizer_compresses_english(demo_model_dir):
    tok = load_tokenizer(demo_model_dir)
    text = "The server batches the requests of many users together."
    assert len(encode(tok, text, add_special_tokens=False)) < len(text) / 3


def test_tokenizer_load_errors(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"sp")
    with pytest.raises(TokenizerLoadError, match="sentencepiece"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="not a valid tokenizer"):
        load_tokenizer(tmp_path)
