"""Scoring end to end, real stacks over plain HTTP (the openai SDK has no rerank call):

- a tiny random Qwen3ForSequenceClassification cross-encoder (num_labels=1, served by its
  architecture with --runner pooling): /rerank order and scores, /score's numbers, equal to
  sentence_transformers.CrossEncoder.predict (sigmoid) on 10 queries x 4 documents; /pooling
  and /v1/embeddings beside them; bad bodies each a 400 on their field, the server answering
  afterwards;
- a 3-label one (--convert classify): /classify's probabilities against transformers' softmax;
  /score on it a 400;
- a tiny random Qwen3 causal LM as a Qwen3-Reranker (vLLM's --hf-overrides, which alone makes
  it a pooling server): scores equal sigmoid(logit[yes] - logit[no]) by transformers on the
  same formatted prompts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pipellm.shared.scoring import reranker_prompt
from tests.scoring_models import (
    YES_NO_OVERRIDES,
    build_classifier,
    build_yes_no,
    classifier_logits,
    yes_no_reference,
)
from tests.stack import Stack
from tests.test_pooling import WORDS

sentence_transformers = pytest.importorskip("sentence_transformers")

MAX_LEN = 256


def serve(path, *flags: str, max_len: int = MAX_LEN) -> Stack:
    stack = Stack(path, *flags, "--max-model-len", str(max_len), "--kv-cache-tokens", "4096",
                  "--dtype", "float32", "--served-model-name", "scorer")
    return stack.start(timeout_s=300)


def queries_and_documents(seed: int = 0, docs: int = 4, words: int = 40
                          ) -> tuple[list[str], list[list[str]]]:
    """10 queries, each with `docs` documents of 3 to `words` words."""
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [text(2, 8) for _ in range(10)], [[text(3, words) for _ in range(docs)]
                                             for _ in range(10)]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ce1")
    build_classifier(path, 1)
    ce = sentence_transformers.CrossEncoder(str(path), device="cpu")
    stack = serve(path, "--runner", "pooling")
    yield stack, ce
    stack.stop()


def post(stack: Stack, path: str, body: dict) -> dict:
    status, answer = stack.post(path, {"model": "scorer", **body})
    assert status == 200, answer
    return answer


def test_rerank_matches_cross_encoder(cross_encoder):
    stack, ce = cross_encoder
    queries, docs = queries_and_documents()
    for q, ds in zip(queries, docs, strict=True):
        ref = ce.predict([(q, d) for d in ds])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            answer = post(stack, path, {"query": q, "documents": ds})
            results = answer["results"]
            assert [r["index"] for r in results] == list(np.argsort(-ref, kind="stable"))
            got = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
            assert np.allclose(got, ref, atol=1e-5), (got, ref)
            assert [r["document"]["text"] for r in results] == [ds[r["index"]]
                                                                 for r in results]
            assert answer["model"] == "scorer" and answer["usage"]["total_tokens"] > 0
    top = post(stack, "/rerank", {"query": queries[0], "top_n": 2, "return_documents": False,
                                  "documents": [{"text": d} for d in docs[0]]})["results"]
    assert len(top) == 2 and "document" not in top[0]
    assert top[0]["relevance_score"] >= top[1]["relevance_score"]


def test_score_matches_cross_encoder(cross_encoder):
    stack, ce = cross_encoder
    queries, docs = queries_and_documents(seed=1)
    pairs = [(q, d) for q, ds in zip(queries, docs, strict=True) for d in ds]
    ref = ce.predict(pairs)
    answer = post(stack, "/score", {"text_1": [a for a, _ in pairs],
                                    "text_2": [b for _, b in pairs]})
    assert answer["object"] == "list" and answer["model"] == "scorer"
    assert [d["index"] for d in answer["data"]] == list(range(len(pairs)))
    assert {d["object"] for d in answer["data"]} == {"score"}
    assert np.allclose([d["score"] for d in answer["data"]], ref, atol=1e-5)
    tok = ce.tokenizer
    tokens = sum(len(tok(a, b)["input_ids"]) for a, b in pairs)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == tokens
    one_to_many = post(stack, "/v1/score", {"text_1": queries[0], "text_2": docs[0]})
    assert np.allclose([d["score"] for d in one_to_many["data"]], ref[:4], atol=1e-5)
    single = post(stack, "/score", {"text_1": queries[0], "text_2": docs[0][0]})
    assert len(single["data"]) == 1 and abs(single["data"][0]["score"] - ref[0]) < 1e-5
    newer = post(stack, "/score", {"queries": queries[0], "items": docs[0]})  # vLLM's names
    assert np.allclose([d["score"] for d in newer["data"]], ref[:4], atol=1e-5)
    logits = post(stack, "/score", {"queries": queries[0], "documents": docs[0],
                                    "use_activation": False})
    assert np.allclose([d["score"] for d in logits["data"]], np.log(ref[:4] / (1 - ref[:4])),
                       atol=1e-4)


def test_rerank_cuts_documents_to_max_tokens_per_doc(cross_encoder):
    """max_tokens_per_doc: each document cut after its fifth token (vLLM's rule, on the
    offsets of transformers' tokenizer), then scored as CrossEncoder scores the cut pairs."""
    stack, ce = cross_encoder
    queries, docs = queries_and_documents(seed=2, words=30)
    tok = ce.tokenizer
    for q, ds in zip(queries[:3], docs[:3], strict=True):
        cut = []
        for d in ds:
            offsets = tok(d, add_special_tokens=False, return_offsets_mapping=True)[
                "offset_mapping"]
            cut.append(d if len(offsets) <= 5 else d[:min(offsets[4][1], offsets[5][0])])
        ref = ce.predict([(q, d) for d in cut])
        answer = post(stack, "/rerank", {"query": q, "documents": ds, "max_tokens_per_doc": 5})
        got = [r["relevance_score"] for r in sorted(answer["results"], key=lambda r: r["index"])]
        assert np.allclose(got, ref, atol=1e-5), (got, ref)
        assert [r["document"]["text"] for r in answer["results"]] == [
            ds[r["index"]] for r in answer["results"]]  # the documents as sent


def test_pooling_and_embeddings_beside_scores(cross_encoder):
    """/pooling gives the model's task (vLLM's): a classifier's probabilities, its logits
    with use_activation false; /v1/embeddings its pooled hidden states."""
    stack, ce = cross_encoder
    texts = ["a river", "blue mountain"]
    pooled = post(stack, "/pooling", {"input": texts, "task": "classify"})
    assert [d["object"] for d in pooled["data"]] == ["pooling"] * 2
    ids = [ce.tokenizer(t)["input_ids"] for t in texts]
    with torch.no_grad():
        ref = classifier_logits(ce.model, ids)[:, 0].numpy()  # transformers, each text alone
    assert np.allclose([d["data"] for d in pooled["data"]], 1 / (1 + np.exp(-ref[:, None])),
                       atol=1e-5)
    logits = post(stack, "/pooling", {"input": texts, "use_activation": False})
    assert np.allclose([d["data"] for d in logits["data"]], ref[:, None], atol=1e-4)
    embedded = post(stack, "/v1/embeddings", {"input": texts})
    assert len(embedded["data"][0]["embedding"]) == 64


BAD = {
    "empty query": ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    "query not a string": ("/rerank", {"query": 3, "documents": ["a"]}, "query"),
    "no documents": ("/rerank", {"query": "a", "documents": []}, "documents"),
    "documents a number": ("/rerank", {"query": "a", "documents": 5}, "documents"),
    "an empty document": ("/rerank", {"query": "a", "documents": ["a", ""]}, "documents"),
    "a document of another type": ("/rerank", {"query": "a", "documents": [5]}, "documents"),
    "a document object without text": ("/rerank", {"query": "a", "documents": [{"t": "a"}]},
                                       "documents"),
    "too many documents": ("/rerank", {"query": "a", "documents": ["b"] * 1025}, "documents"),
    "top_n < 0": ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    "return_documents not a bool": ("/rerank", {"query": "a", "documents": ["b"],
                                                "return_documents": "yes"},
                                    "return_documents"),
    "a document over the context": ("/v2/rerank", {"query": "a", "documents": [
        " ".join(["blue"] * 2 * MAX_LEN)]}, "documents"),
    "text_1 missing": ("/score", {"text_2": "a"}, "text_1"),
    "text_2 empty list": ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    "text_1 and text_2 counts": ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
                                 "text_2"),
    "score over the context": ("/v1/score", {"text_1": "a", "text_2": " ".join(
        ["blue"] * 2 * MAX_LEN)}, "text_2"),
    "classify empty input": ("/classify", {"input": []}, "input"),
    "pooling bad format": ("/pooling", {"input": "a", "encoding_format": "hex"},
                           "encoding_format"),
    "pooling another task": ("/pooling", {"input": "a", "task": "embed"}, "task"),
    "pooling a removed task": ("/pooling", {"input": "a", "task": "score"}, "task"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_400(cross_encoder, case):
    stack, _ = cross_encoder
    path, body, param = BAD[case]
    status, answer = stack.post(path, {"model": "scorer", **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert len(post(stack, "/rerank", {"query": "a", "documents": ["b"]})["results"]) == 1


def test_classify_three_labels(tmp_path):
    model = build_classifier(tmp_path, 3, seed=5)
    stack = serve(tmp_path, "--convert", "classify")
    try:
        texts = [" ".join(random.Random(i).choices(WORDS, k=3 + 2 * i)) for i in range(12)]
        answer = post(stack, "/classify", {"input": texts})
        tok = AutoTokenizer.from_pretrained(str(tmp_path))
        ids = [tok(t)["input_ids"] for t in texts]
        ref = torch.softmax(classifier_logits(model, ids), -1).numpy()
        probs = np.array([d["probs"] for d in answer["data"]])
        assert np.allclose(probs, ref, atol=1e-5), np.abs(probs - ref).max()
        assert [d["label"] for d in answer["data"]] == [f"LABEL_{i}" for i in ref.argmax(1)]
        assert {d["num_classes"] for d in answer["data"]} == {3}
        assert answer["usage"]["total_tokens"] == sum(map(len, ids))
        status, err = stack.post("/score", {"text_1": "a", "text_2": "b"})
        assert status == 400 and err["error"]["param"] == "model" and "/classify" in \
            err["error"]["message"]
    finally:
        stack.stop()


def test_yes_no_reranker(tmp_path):
    model = build_yes_no(tmp_path)
    # the prompt's template takes ~300 of the demo tokenizer's byte-level tokens
    stack = serve(tmp_path, "--hf-overrides", YES_NO_OVERRIDES, max_len=1024)
    try:
        tok = AutoTokenizer.from_pretrained(str(tmp_path))
        queries, docs = queries_and_documents(seed=2, docs=3, words=12)
        for i, (q, ds) in enumerate(zip(queries, docs, strict=True)):
            prompts = [reranker_prompt(q, d) for d in ds]
            ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
            ref = np.array(yes_no_reference(model, ids))
            answer = post(stack, "/rerank", {"query": q, "documents": ds})
            got = [r["relevance_score"] for r in sorted(answer["results"],
                                                        key=lambda r: r["index"])]
            assert np.allclose(got, ref, atol=1e-3), (got, ref)
            assert [r["index"] for r in answer["results"]] == list(np.argsort(-ref,
                                                                             kind="stable"))
            if i == 0:
                score = post(stack, "/score", {"text_1": q, "text_2": ds})
                assert np.allclose([d["score"] for d in score["data"]], ref, atol=1e-3)
                # the instruction the model card asks users to write for their task
                task = "Given a question about rivers, find the passage that answers it"
                ids = [tok(reranker_prompt(q, d, task), add_special_tokens=False)["input_ids"]
                       for d in ds]
                told = np.array(yes_no_reference(model, ids))
                answer = post(stack, "/rerank", {"query": q, "documents": ds,
                                                 "instruction": task})
                assert np.allclose([r["relevance_score"] for r in sorted(
                    answer["results"], key=lambda r: r["index"])], told, atol=1e-3)
                assert not np.allclose(told, ref, atol=1e-3)
        status, err = stack.post("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]})
        assert status == 400 and err["error"]["param"] == "model"
    finally:
        stack.stop()
