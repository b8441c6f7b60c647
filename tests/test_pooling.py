"""The pooling path (pipellm/services/compute/pooling, LLMEngine.embed) against
sentence-transformers.

Tiny random Qwen3 (last token + normalize, as Qwen3-Embedding) and Llama (mean + normalize)
models get sentence-transformers configs; the engine's embeddings of 50 sentences of varied
lengths must match SentenceTransformer.encode's (cosine >= 0.999 each, float32), in full and
truncated to a Matryoshka width (truncate_dim).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.pooling import finish, forward_budget, pool
from pipellm.services.compute.pooling.embedder import MIN_SHARED, shared_prefix
from pipellm.services.compute.pooling.forward import hidden_states, prefill_batch
from pipellm.shared.config import EngineConfig
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.sampling import InvalidParams
from pipellm.shared.settings import with_settings
from tests.hf_models import build_hf_model

sentence_transformers = pytest.importorskip("sentence_transformers")

WORDS = ("the a model cache token prefill decode pooling vector mean last embedding query "
         "document search rank score cosine river mountain seven blue quickly").split()
MODES = {"qwen3": "last", "llama": "mean"}
MODE_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
             "cls": "pooling_mode_cls_token"}


def write_st_config(path: Path, hidden: int, mode: str, normalize: bool = True) -> None:
    """The sentence-transformers files of a model directory: Transformer, Pooling, Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024,
                                                                "do_lower_case": False}))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "include_prompt": True,
               **{key: key == MODE_KEYS[mode] for key in MODE_KEYS.values()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def sentences(n: int = 50, seed: int = 0) -> list[str]:
    """`n` sentences of 1 to 60 words, and one of 150."""
    rng = random.Random(seed)
    lengths = [1, 2, 150] + [rng.randint(1, 60) for _ in range(n - 3)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in lengths]


@pytest.fixture(scope="module", params=sorted(MODES))
def embedder(request, tmp_path_factory):
    """(engine, SentenceTransformer, token ids of sentences(), the texts) of one arch."""
    arch = request.param
    path = tmp_path_factory.mktemp(f"pool-{arch}")
    build_hf_model(path, arch, with_tokenizer=True, initializer_range=0.2, seed=3)
    write_st_config(path, 64, MODES[arch])
    # padding (batches of sentences) needs a pad token; the attention mask hides it
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "</s>"}))
    st = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    texts = sentences()
    ids = [st.tokenizer(t)["input_ids"] for t in texts]
    eng = build_engine(with_settings(EngineConfig(), model=str(path), device="cpu",
                                     dtype="float32", max_model_len=512, kv_cache_tokens=2048,
                                     max_batched_tokens=512))
    return eng, st, ids, texts


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.mark.parametrize("dimensions", [None, 16])
def test_matches_sentence_transformers(embedder, dimensions):
    eng, st, ids, texts = embedder
    assert eng.pooling.mode in ("last", "mean") and eng.pooling.normalize
    ours = eng.embed(ids, dimensions=dimensions)
    ref = st.encode(texts, batch_size=8, convert_to_numpy=True, truncate_dim=dimensions)
    width = dimensions or 64
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (len(texts), width)
    assert np.allclose(np.linalg.norm(ours.numpy(), axis=1), 1, atol=1e-5)
    cos = cosines(ours.numpy(), ref)
    assert cos.min() >= 0.999, (cos.argmin(), cos.min())
    # the sentences' vectors differ: a pooling of the wrong rows would not match
    assert cosines(ours.numpy()[:-1], ours.numpy()[1:]).min() < 0.99
    assert eng.kv.allocator.free_slots == eng.kv.allocator.capacity  # the slots came back


def test_hidden_states_match_the_model_forward(embedder):
    """The prefill-only forward's rows equal LlamaModel.forward_hidden's final-normed ones (it
    mirrors that loop without the LM head)."""
    eng, _, ids, _ = embedder
    runner, group = eng.runner, ids[:6]
    lens = [len(p) for p in group]
    starts = [sum(lens[:i]) for i in range(len(group))]
    batch = prefill_batch(group, starts, runner.device)
    rows = hidden_states(runner.model, batch, runner.kv)
    everything = torch.arange(sum(lens))
    _, ref = runner.model.forward_hidden(replace(batch, logits_indices=everything), runner.kv)
    assert rows.shape == (sum(lens), 64)
    assert torch.allclose(rows, ref, atol=1e-5)


def test_busy_kv_cache(embedder):
    """With most slots held (as by running requests), batches run in the heads that fit, the
    held slots' K/V untouched; with too few free slots for a prompt, a clear error."""
    eng, _, ids, _ = embedder
    alloc, kv = eng.kv.allocator, eng.runner.kv
    full = eng.embed(ids)
    held = alloc.allocate(alloc.capacity - 400)
    kv.k[:, held:held + 8].fill_(3.0)  # K of the held slots, marked
    try:
        assert torch.allclose(eng.embed(ids), full, atol=1e-5)
        assert (kv.k[:, held:held + 8] == 3.0).all()
        with pytest.raises(RuntimeError, match="free KV slots"):
            eng.embed([[5] * 401])
    finally:
        alloc.free(held)
    assert alloc.free_slots == alloc.capacity


def test_a_shared_prefix_runs_once(embedder, monkeypatch):
    """Prompts that all start with one long instruction embed as each does alone; pooled by
    the last token, the instruction runs once (a forward of its own), each prompt's rest in the
    next; mean pooling reads every row, so it runs every prompt whole."""
    eng, _, ids, _ = embedder
    prefix = ids[2][:60]  # the start of the 150-word sentence before each
    prompts = [prefix + p for p in ids[3:11]]
    assert sum(map(len, prompts)) <= forward_budget(eng)  # one forward's group
    alone = torch.cat([eng.embed([p]) for p in prompts])
    fed, forward = [], eng.runner.pooled_hidden

    def counted(batch, rows=None, moves=()):
        fed.append(batch.input_ids.numel())
        return forward(batch, rows, moves)

    monkeypatch.setattr(eng.runner, "pooled_hidden", counted)
    together = eng.embed(prompts)
    assert torch.allclose(together, alone, atol=1e-5), (together - alone).abs().max()
    shared, total = shared_prefix(prompts), sum(map(len, prompts))
    assert shared >= len(prefix)
    assert fed == ([shared, total - len(prompts) * shared] if eng.pooling.mode == "last"
                   else [total])
    assert eng.kv.allocator.free_slots == eng.kv.allocator.capacity


def test_shared_prefix_bounds():
    p = list(range(3, 40))
    assert shared_prefix([p]) == 0  # one prompt: nothing to share
    assert shared_prefix([p, p + [1]]) == len(p) - 1  # each prompt keeps a row to pool
    assert shared_prefix([p[:20] + [1], p[:20] + [2], p[:25]]) == 20
    assert shared_prefix([p[:MIN_SHARED - 1] + [1], p[:MIN_SHARED - 1] + [2]]) == 0


def test_bad_prompts_are_clear_errors(embedder):
    eng, _, ids, _ = embedder
    with pytest.raises(InvalidParams, match="empty"):
        eng.embed([ids[0], []])
    with pytest.raises(InvalidParams, match="context"):
        eng.embed([[5] * (eng.max_model_len + 1)])
    with pytest.raises(InvalidParams, match="dimensions"):
        eng.embed([ids[0]], dimensions=65)
    assert eng.kv.allocator.free_slots == eng.kv.allocator.capacity
    assert eng.embed(ids[:1]).shape == (1, 64)  # still serving


def test_pool_modes_against_reference():
    torch.manual_seed(0)
    lens = [1, 5, 3, 9]
    hidden = torch.randn(sum(lens), 8)
    parts = torch.split(hidden, lens)
    assert torch.allclose(pool(hidden, lens, "last"), torch.stack([p[-1] for p in parts]))
    assert torch.allclose(pool(hidden, lens, "cls"), torch.stack([p[0] for p in parts]))
    assert torch.allclose(pool(hidden, lens, "mean"), torch.stack([p.mean(0) for p in parts]),
                          atol=1e-6)
    out = finish(hidden[:4], True, 3)
    ref = hidden[:4, :3] / hidden[:4, :3].norm(dim=1, keepdim=True)
    assert torch.allclose(out, ref, atol=1e-6)


def test_config_from_dir(tmp_path):
    assert PoolingConfig.from_dir(tmp_path) == PoolingConfig()  # no modules.json
    write_st_config(tmp_path, 32, "cls", normalize=False)
    cfg = PoolingConfig.from_dir(tmp_path)
    assert (cfg.mode, cfg.normalize, cfg.dimension) == ("cls", False, 32)
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"matryoshka_dimensions": [32, 8, 16]}))
    cfg = PoolingConfig.from_dir(tmp_path)
    assert cfg.matryoshka_dims == (8, 16, 32) and cfg.output_dim(16) == 16
    assert cfg.prompts == ()
    with pytest.raises(ValueError):
        cfg.output_dim(12)
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "Q: ", "document": ""}}))
    assert PoolingConfig.from_dir(tmp_path).prompts == (("query", "Q: "), ("document", ""))
    (tmp_path / "config.json").write_text(json.dumps({"task_instructions": {"query": "I: "}}))
    assert PoolingConfig.from_dir(tmp_path).prompts == (("query", "I: "),)  # vLLM's order
    with pytest.raises(ValueError):
        PoolingConfig(mode="max")


def test_gguf_embedder_pools_as_its_metadata_says(tmp_path):
    """A GGUF file pools as its `{arch}.pooling_type` says (llama.cpp's: 1 mean), normalized;
    the engine on it matches SentenceTransformer on the same weights as an HF directory; vLLM's
    --pooler-config overrides the mode and normalization; no pooling_type: the last token."""
    from tests.gguf_files import Q, write_gguf

    hf_dir = tmp_path / "hf"
    model = build_hf_model(hf_dir, "llama", with_tokenizer=True, initializer_range=0.2, seed=4)
    write_st_config(hf_dir, 64, "mean")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "</s>"}))
    gguf = write_gguf(tmp_path / "embed.gguf", model, Q.F32, meta={"llama.pooling_type": 1})
    assert PoolingConfig.resolve(gguf) == PoolingConfig("mean", True, 64)
    st = sentence_transformers.SentenceTransformer(str(hf_dir), device="cpu")
    texts = sentences(20, seed=1)
    eng = build_engine(with_settings(EngineConfig(), model=str(gguf), device="cpu",
                                     dtype="float32", max_model_len=512, kv_cache_tokens=2048))
    ours = eng.embed([st.tokenizer(t)["input_ids"] for t in texts]).numpy()
    assert cosines(ours, st.encode(texts, convert_to_numpy=True)).min() >= 0.999
    for off in ("normalize", "use_activation"):
        config = json.dumps({"pooling_type": "LAST", off: False})
        assert PoolingConfig.resolve(gguf, config) == PoolingConfig("last", False, 64)
    plain = write_gguf(tmp_path / "plain.gguf", model, Q.F32)
    assert PoolingConfig.resolve(plain).mode == "last"
    for bad in ("{", '{"pooling_type": "MAX"}', '{"dimensions": 8}', "[1]"):
        with pytest.raises(ValueError, match="pooler-config"):
            PoolingConfig.resolve(gguf, bad)
