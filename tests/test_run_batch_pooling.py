"""`pipellm run-batch` on pooling models, as a user runs it: /v1/embeddings, /score and
/rerank lines (every spelling vLLM's run_batch takes) on a tiny random Qwen3 embedder with
sentence-transformers configs: the vectors equal SentenceTransformer.encode's, the scores the
cosine of its embeddings; bad lines get their 400s and the others carry on. Then a
cross-encoder in process: its score lines equal CrossEncoder.predict."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.services.run_batch import run_batch
from pipellm.services.tokenizer.service import Tokenizer
from pipellm.shared.config import EngineConfig
from pipellm.shared.settings import with_settings
from tests.hf_models import build_hf_model
from tests.scoring_models import build_classifier
from tests.test_pooling import cosines, sentences, write_st_config

sentence_transformers = pytest.importorskip("sentence_transformers")

MODEL = "emb"
MAX_LEN = 512


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL, **body}})


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("emb")
    build_hf_model(path, "qwen3", with_tokenizer=True, initializer_range=0.2, seed=3)
    write_st_config(path, 64, "last")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "</s>"}))
    return path, sentence_transformers.SentenceTransformer(str(path), device="cpu")


TEXTS = sentences(9, seed=12)
QUERY, DOCS = TEXTS[0], TEXTS[1:6]


@pytest.fixture(scope="module")
def results(embedder, tmp_path_factory):
    path, _ = embedder
    lines = [
        line("embed", "/v1/embeddings", {"input": TEXTS}),
        line("embed-ids", "/v1/embeddings", {"input": [[5, 6, 7], [8]], "dimensions": 16}),
        line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        line("empty", "/v1/embeddings", {"input": []}),
        line("long-doc", "/v1/rerank", {"query": "q", "documents": ["blue " * 3 * MAX_LEN]}),
        line("bad-id", "/v1/embeddings", {"input": [[5, 10**6]]}),
        line("bytes", "/v1/embeddings", {"input": "a", "encoding_format": "bytes"}),
        line("classify", "/classify", {"input": "a"}),
        *(line(f"score{p}", p, {"text_1": QUERY, "text_2": DOCS}) for p in ("/score",
                                                                            "/v1/score")),
        line("score-pairs", "/v1/score", {"text_1": TEXTS[:3], "text_2": TEXTS[3:6]}),
        *(line(f"rerank{p}", p, {"query": QUERY, "documents": DOCS, "top_n": 3})
          for p in ("/rerank", "/v1/rerank", "/v2/rerank")),
    ]
    tmp = tmp_path_factory.mktemp("batch")
    src, dst = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "run-batch", "-i",
                           str(src), "-o", str(dst), "--model", str(path), "--runner", "pooling",
                           "--served-model-name", MODEL, "--max-model-len", str(MAX_LEN),
                           "--kv-cache-tokens", "4096", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc, {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}


def body(out: dict, custom_id: str) -> dict:
    response = out[custom_id]["response"]
    assert response["status_code"] == 200, response
    return response["body"]


def test_every_line_answered_in_vllms_shape(results):
    proc, out = results
    assert list(out) == ["embed", "embed-ids", "chat", "empty", "long-doc", "bad-id",
                         "bytes", "classify", "score/score", "score/v1/score", "score-pairs",
                         "rerank/rerank", "rerank/v1/rerank", "rerank/v2/rerank"]
    for o in out.values():
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert set(o["response"]) == {"status_code", "request_id", "body"}
    assert proc.stdout.startswith("run-batch: 14 requests (6 failed)")


def test_embeddings_lines_equal_sentence_transformers(results, embedder):
    _, out = results
    _, st = embedder
    answer = body(out, "embed")
    assert answer["object"] == "list" and answer["model"] == MODEL
    ours = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
    assert cosines(ours, st.encode(TEXTS)).min() >= 0.999
    assert answer["usage"]["prompt_tokens"] == sum(len(st.tokenizer(t)["input_ids"])
                                                   for t in TEXTS)
    ids = body(out, "embed-ids")
    assert [len(d["embedding"]) for d in ids["data"]] == [16, 16]
    assert ids["usage"]["prompt_tokens"] == 4


def test_score_and_rerank_lines_are_cosines(results, embedder):
    _, out = results
    _, st = embedder
    ref = sentence_transformers.util.cos_sim(st.encode([QUERY]), st.encode(DOCS))[0].numpy()
    for path in ("/score", "/v1/score"):
        scores = [d["score"] for d in body(out, f"score{path}")["data"]]
        assert np.allclose(scores, ref, atol=1e-4)
    pairs = sentence_transformers.util.pairwise_cos_sim(st.encode(TEXTS[:3]),
                                                        st.encode(TEXTS[3:6])).numpy()
    assert np.allclose([d["score"] for d in body(out, "score-pairs")["data"]], pairs,
                       atol=1e-4)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        results_ = body(out, f"rerank{path}")["results"]
        assert [r["index"] for r in results_] == list(np.argsort(-ref)[:3])
        assert np.allclose([r["relevance_score"] for r in results_],
                           np.sort(ref)[::-1][:3], atol=1e-4)
        assert results_[0]["document"] == {"text": DOCS[results_[0]["index"]]}


def test_bad_lines_get_400s_naming_their_field(results):
    _, out = results
    for custom_id, param, words in (("chat", "model", "pooling model"),
                                    ("empty", "input", "must not be empty"),
                                    ("long-doc", "documents", "maximum context length"),
                                    ("bad-id", "input", "outside the vocabulary"),
                                    ("bytes", "encoding_format", "not available"),
                                    ("classify", "url", "url must be POST")):
        response = out[custom_id]["response"]
        assert response["status_code"] == 400, (custom_id, response)
        error = response["body"]["error"]
        assert error["param"] == param and words in error["message"], (custom_id, error)


def test_cross_encoder_score_lines_in_process(tmp_path):
    build_classifier(tmp_path, 1)
    ce = sentence_transformers.CrossEncoder(str(tmp_path), device="cpu")
    cfg = with_settings(EngineConfig(), model=str(tmp_path), device="cpu", dtype="float32",
                        max_model_len=MAX_LEN, kv_cache_tokens=4096, runner="pooling")
    lines = [line("s", "/score", {"text_1": QUERY, "text_2": DOCS}),
             line("r", "/v2/rerank", {"query": QUERY, "documents": DOCS}),
             line("e", "/v1/embeddings", {"input": "a"})]
    dst = tmp_path / "out.jsonl"
    with open(dst, "w") as f:
        n, failed, _, _ = run_batch(build_engine(cfg), Tokenizer(cfg), MODEL, lines, f,
                                    progress=None)
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    ref = ce.predict([(QUERY, d) for d in DOCS])
    assert (n, failed) == (3, 0)
    assert np.allclose([d["score"] for d in body(out, "s")["data"]], ref, atol=1e-4)
    assert [r["index"] for r in body(out, "r")["results"]] == list(np.argsort(-ref))
    assert len(body(out, "e")["data"][0]["embedding"]) == 64
