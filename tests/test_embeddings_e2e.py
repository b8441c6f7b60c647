"""`--runner pooling` end to end: real stacks on a tiny random Qwen3 embedder with
sentence-transformers configs (last token, normalized, Matryoshka widths) and a Llama one
(mean pooling, `--convert embed`), driven by the official openai SDK, unchanged. Every vector
matches SentenceTransformer.encode of the same sentence (cosine >= 0.999), as floats and as
base64; /score and /rerank are the cosine of those embeddings (sentence-transformers'
cos_sim); bad input is a 400 naming its field, and the server answers afterwards; a generation
request to a pooling server is a 400."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.hf_models import build_hf_model
from tests.stack import Stack
from tests.test_pooling import cosines, sentences, write_st_config

sentence_transformers = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")

MAX_LEN = 512
WIDTHS = [16, 32, 64]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = {"query": "Instruct: find the passage that answers\nQuery: ", "document": ""}


def embedder(path, arch: str, mode: str, widths: list[int] | None, *flags: str):
    """A tiny random `arch` model with sentence-transformers configs at `path`, served with
    `flags`: (openai client, model name, SentenceTransformer, stack)."""
    build_hf_model(path, arch, with_tokenizer=True, initializer_range=0.2, seed=3)
    write_st_config(path, 64, mode)
    if widths:  # and the instruction prompts Cohere's input_type picks
        (path / "config_sentence_transformers.json").write_text(json.dumps(
            {"matryoshka_dimensions": widths, "prompts": PROMPTS}))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    st = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    stack = Stack(path, *flags, "--max-model-len", str(MAX_LEN), "--kv-cache-tokens", "4096",
                  "--dtype", "float32", "--served-model-name", "embedder")
    stack.start(timeout_s=300)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="any", max_retries=0)
    return client, "embedder", st, stack


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A pooling server on a Qwen3 embedder: last token, normalized, Matryoshka widths."""
    out = embedder(tmp_path_factory.mktemp("qwen3"), "qwen3", "last", WIDTHS,
                   "--runner", "pooling")
    yield out
    out[3].stop()


@pytest.fixture(scope="module")
def llama_served(tmp_path_factory):
    """One on a Llama embedder (mean pooling, normalized, any width), by vLLM's --convert,
    with two compute processes (the tokenizer gives them requests in turn)."""
    out = embedder(tmp_path_factory.mktemp("llama"), "llama", "mean", None,
                   "--convert", "embed", "--data-parallel-size", "2")
    yield out
    out[3].stop()


def vectors(response) -> np.ndarray:
    """The response's vectors: floats, or base64 strings when asked for explicitly (the SDK
    decodes the base64 it asks for itself, by default, into floats)."""
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4")
                     if isinstance(d.embedding, str) else d.embedding
                     for d in response.data], dtype=np.float32)


def test_the_banner_says_what_it_serves(served):
    banner = served[3].wait_for_log("pooling runner: embeddings and scores")
    assert "sampling defaults" not in banner and "tool_choice" not in banner


def test_fifty_sentences_float_and_base64(served):
    client, model, st, _ = served
    texts = sentences()
    ref = st.encode(texts, batch_size=8, convert_to_numpy=True)
    for fmt in ("float", "base64"):
        r = client.embeddings.create(model=model, input=texts, encoding_format=fmt)
        ours = vectors(r)
        assert ours.shape == (50, 64)
        cos = cosines(ours, ref)
        assert cos.min() >= 0.999, (fmt, cos.argmin(), cos.min())
    tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
    assert r.model == model and r.object == "list"


def test_mean_pooling_llama(llama_served):
    client, model, st, _ = llama_served
    texts = sentences(seed=2)
    for fmt, width in (("float", None), ("base64", 24)):
        extra = {} if width is None else {"dimensions": width}
        ours = vectors(client.embeddings.create(model=model, input=texts, encoding_format=fmt,
                                                **extra))
        ref = st.encode(texts, batch_size=8, truncate_dim=width)
        assert ours.shape == (50, width or 64)
        assert cosines(ours, ref).min() >= 0.999, fmt
    ref = st.encode(texts[:8])
    for i in range(8):  # one at a time: each compute answers some
        one = vectors(client.embeddings.create(model=model, input=texts[i]))
        assert cosines(one, ref[i:i + 1])[0] >= 0.999


def test_one_string_token_ids_and_dimensions(served):
    client, model, st, _ = served
    texts = sentences(5, seed=1)
    one = vectors(client.embeddings.create(model=model, input=texts[0]))  # SDK: base64
    assert cosines(one, st.encode(texts[:1]))[0] >= 0.999
    ids = [st.tokenizer(t)["input_ids"] for t in texts]
    by_ids = vectors(client.embeddings.create(model=model, input=ids[1],
                                              encoding_format="float"))
    assert cosines(by_ids, st.encode(texts[1:2]))[0] >= 0.999
    many = vectors(client.embeddings.create(model=model, input=ids))
    assert cosines(many, st.encode(texts)).min() >= 0.999
    raw = vectors(client.embeddings.create(model=model, input=texts, encoding_format="float",
                                           extra_body={"use_activation": False}))
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 0.01  # not normalized
    assert cosines(raw, st.encode(texts)).min() >= 0.999  # the same direction
    for fmt in ("float", "base64"):
        small = vectors(client.embeddings.create(model=model, input=texts, dimensions=16,
                                                 encoding_format=fmt))
        ref = st.encode(texts, truncate_dim=16)
        assert small.shape == (5, 16) and cosines(small, ref).min() >= 0.999
        assert np.allclose(np.linalg.norm(small, axis=1), 1, atol=1e-4)


def test_an_empty_string_embeds_as_its_special_tokens(served):
    """"" embeds where the tokenizer adds special tokens (this one adds BOS), as
    sentence-transformers and vLLM embed it."""
    client, model, st, _ = served
    r = client.embeddings.create(model=model, input=["a river", ""], encoding_format="float")
    assert cosines(vectors(r), st.encode(["a river", ""])).min() >= 0.999
    assert r.usage.prompt_tokens == sum(len(st.tokenizer(t)["input_ids"])
                                        for t in ("a river", ""))


def test_truncate_prompt_tokens(served):
    client, model, st, _ = served
    long = " ".join(["river mountain seven blue"] * 200)
    ids = st.tokenizer(long)["input_ids"]
    assert len(ids) > MAX_LEN
    r = client.embeddings.create(model=model, input=long, extra_body={
        "truncate_prompt_tokens": 10}, encoding_format="float")
    assert r.usage.prompt_tokens == 10
    # the first 10 tokens by default (vLLM's pooling runner), the last 10 with "left"
    head = client.embeddings.create(model=model, input=ids[:10], encoding_format="float")
    assert cosines(vectors(r), vectors(head))[0] >= 0.9999
    left = client.embeddings.create(model=model, input=long, encoding_format="float", extra_body={
        "truncate_prompt_tokens": 10, "truncation_side": "left"})
    tail = client.embeddings.create(model=model, input=ids[-10:], encoding_format="float")
    assert cosines(vectors(left), vectors(tail))[0] >= 0.9999
    assert cosines(vectors(left), vectors(head))[0] < 0.999
    r = client.embeddings.create(model=model, input=long, extra_body={
        "truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == MAX_LEN


SDK_ARGS = ("model", "input", "encoding_format", "dimensions", "user")
BAD = {
    "empty list": ({"input": []}, "input"),
    "too many inputs": ({"input": ["a"] * 2049}, "input"),
    "over the context": ({"input": " ".join(["blue"] * 2 * MAX_LEN)}, "input"),
    "token ids over the context": ({"input": [5] * (MAX_LEN + 1)}, "input"),
    "token id out of vocab": ({"input": [[5, 6], [5, 10**6]]}, "input"),
    "mixed input": ({"input": ["a", [5]]}, "input"),
    "not a Matryoshka width": ({"input": "a", "dimensions": 12}, "dimensions"),
    "dimensions 0": ({"input": "a", "dimensions": 0}, "dimensions"),
    "dimensions over the width": ({"input": "a", "dimensions": 65}, "dimensions"),
    "encoding_format": ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    "truncate over the context": ({"input": "a", "truncate_prompt_tokens": MAX_LEN + 1},
                                  "truncate_prompt_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_400(served, case):
    client, model, _, stack = served
    body, param = BAD[case]
    body = {"model": model, **body}
    status, answer = stack.post("/v1/embeddings", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == \
        "invalid_request_error", answer
    assert "Traceback" not in answer["error"]["message"]
    sdk = {k: v for k, v in body.items() if k in SDK_ARGS}
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(**sdk, extra_body={k: v for k, v in body.items()
                                                    if k not in SDK_ARGS})
    assert len(client.embeddings.create(model=model, input="still here").data) == 1


def test_generation_apis_are_a_400_and_models_lists_it(served):
    client, model, _, stack = served
    with pytest.raises(openai.BadRequestError, match="Chat Completions API"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="Completions API"):
        client.completions.create(model=model, prompt="hi")
    assert [m.id for m in client.models.list().data] == [model]
    assert stack.get("/health")[0] == 200


def test_score_and_rerank_are_the_cosine_of_embeddings(served, llama_served):
    """On an embedding model /score and /rerank (every path) score a pair by the cosine of the
    two texts' embeddings (vLLM's bi-encoder), equal to sentence-transformers' cos_sim."""
    for _, model, st, stack in (served, llama_served):
        texts = sentences(9, seed=4)
        query, docs = texts[0], texts[1:]
        ref = sentence_transformers.util.cos_sim(st.encode([query]), st.encode(docs))[0]
        ref = ref.numpy()
        assert ref.max() - ref.min() > 0.02  # the documents' scores differ
        tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            status, answer = stack.post(path, {"model": model, "query": query,
                                               "documents": docs, "top_n": 5})
            assert status == 200, answer
            got = [r["index"] for r in answer["results"]]
            assert got == list(np.argsort(-ref)[:5])
            scores = [r["relevance_score"] for r in answer["results"]]
            assert np.allclose(scores, ref[got], atol=1e-4)
            assert answer["usage"]["total_tokens"] == tokens  # the query once
        for path in ("/score", "/v1/score"):
            status, answer = stack.post(path, {"model": model, "text_1": query,
                                               "text_2": docs})
            assert status == 200, answer
            assert np.allclose([d["score"] for d in answer["data"]], ref, atol=1e-4)
        status, answer = stack.post("/score", {"model": model, "queries": query,
                                               "documents": docs})  # vLLM's newer names
        assert status == 200 and np.allclose([d["score"] for d in answer["data"]], ref,
                                             atol=1e-4), answer
        pairs = sentence_transformers.util.pairwise_cos_sim(st.encode(docs[:4]),
                                                            st.encode(docs[4:]))
        status, answer = stack.post("/score", {"model": model, "text_1": docs[:4],
                                               "text_2": docs[4:]})
        assert status == 200 and np.allclose([d["score"] for d in answer["data"]],
                                             pairs.numpy(), atol=1e-4)
        status, answer = stack.post("/classify", {"model": model, "input": "a"})
        assert status == 400 and "without a scoring head" in answer["error"]["message"]
        status, answer = stack.post("/rerank", {"model": model, "query": query,
                                                "documents": ["blue " * 2 * MAX_LEN]})
        assert status == 400 and answer["error"]["param"] == "documents", answer


def test_cohere_embed_with_the_cohere_sdk(served):
    """Cohere's /v2/embed through the official cohere SDK, unchanged: input_type picks the
    model's prompt (search_query: its `query` prompt), as SentenceTransformer.encode's
    prompt_name prepends it; the embedding types from the same floats; output_dimension,
    truncation and a bad input_type as Cohere's clients meet them."""
    cohere = pytest.importorskip("cohere")
    _, model, st, stack = served
    co = cohere.ClientV2(base_url=stack.url, api_key="any", timeout=120)
    texts = sentences(6, seed=5)
    r = co.embed(model=model, input_type="search_query", texts=texts,
                 embedding_types=["float", "binary", "ubinary", "base64"])
    got = np.array(r.embeddings.float_, dtype=np.float32)
    assert cosines(got, st.encode(texts, prompt_name="query")).min() >= 0.999
    assert cosines(got, st.encode(texts)).max() < 0.999  # the prompt changed every vector
    bits = np.packbits(got >= 0, axis=1)
    assert r.embeddings.ubinary == bits.tolist()
    assert r.embeddings.binary == (bits.astype(np.int16) - 128).tolist()
    assert np.array_equal(np.stack([np.frombuffer(base64.b64decode(b), "<f4")
                                    for b in r.embeddings.base64]), got)
    assert r.texts == texts and r.meta.billed_units.input_tokens > 0
    docs = co.embed(model=model, input_type="search_document", texts=texts[:2],
                    output_dimension=16)
    ref = st.encode(texts[:2], prompt_name="document", truncate_dim=16)
    assert cosines(np.array(docs.embeddings.float_), ref).min() >= 0.999
    long = " ".join(["river mountain seven blue"] * 50)
    head = co.embed(model=model, input_type="search_document", texts=[long], max_tokens=10)
    assert head.meta.billed_units.input_tokens == 10
    with pytest.raises(cohere.errors.BadRequestError) as e:
        co.embed(model=model, input_type="search_document", texts=[long], max_tokens=10,
                 truncate="NONE")
    assert "max_tokens=10" in str(e.value.body)
    with pytest.raises(cohere.errors.BadRequestError) as e:
        co.embed(model=model, input_type="classification", texts=texts)
    assert "document, query" in str(e.value.body)


def test_chat_conversations_embed_as_their_rendered_ids(served):
    """vLLM's chat embeddings requests through the openai SDK (a conversation as `input`, a
    batch in `messages`) and Cohere's `inputs`: each vector equals the one of the token ids
    transformers' apply_chat_template gives the conversation."""
    from transformers import AutoTokenizer

    client, model, st, stack = served
    hf = AutoTokenizer.from_pretrained(st.tokenizer.name_or_path)
    convs = [[{"role": "system", "content": "answer briefly"},
              {"role": "user", "content": text}] for text in sentences(3, seed=6)]
    ids = [hf.apply_chat_template(c, tokenize=True, return_dict=False) for c in convs]
    ref = vectors(client.embeddings.create(model=model, input=ids, encoding_format="float"))
    one = vectors(client.embeddings.create(model=model, input=convs[0], encoding_format="float"))
    assert cosines(one, ref[:1])[0] >= 0.9999
    status, answer = stack.post("/v1/embeddings", {"model": model, "messages": convs})
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == sum(map(len, ids))
    batch = np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)
    assert cosines(batch, ref).min() >= 0.9999
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(base_url=stack.url, api_key="any", timeout=120)
    r = co.embed(model=model, input_type="search_document", inputs=[
        {"content": [{"type": "text", "text": c[1]["content"]}]} for c in convs])
    alone = [hf.apply_chat_template(c[1:], tokenize=True, return_dict=False) for c in convs]
    want = vectors(client.embeddings.create(model=model, input=alone, encoding_format="float"))
    assert cosines(np.array(r.embeddings.float_, dtype=np.float32), want).min() >= 0.9999


def test_sagemaker_invocations_on_a_pooling_server(served):
    """/invocations on an embedder: `input` embeds, `query` + `documents` rerank, as the
    endpoints themselves answer."""
    _, model, _, stack = served
    texts = sentences(3, seed=8)
    body = {"model": model, "input": texts, "encoding_format": "float"}
    assert stack.post("/invocations", body)[1]["data"] == stack.post("/v1/embeddings",
                                                                      body)[1]["data"]
    rerank = {"model": model, "query": texts[0], "documents": texts[1:]}
    status, via = stack.post("/invocations", rerank)
    assert status == 200 and via["results"] == stack.post("/rerank", rerank)[1]["results"]
    assert stack.post("/invocations", {"model": model, "prompt": "x"})[0] == 400


def test_bytes_and_embed_dtypes_as_torch_casts_them(served):
    """vLLM's encoding_format bytes / bytes_only, embed_dtype and endianness: the body holds
    each vector cast as torch casts float32 to that dtype, the metadata header says where;
    base64 in a dtype is the same bytes."""
    import urllib.request

    import torch

    client, model, _, stack = served
    texts = sentences(3, seed=7)
    floats = vectors(client.embeddings.create(model=model, input=texts, encoding_format="float"))
    views = {"float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

    def post(body: dict) -> tuple[bytes, dict]:
        req = urllib.request.Request(stack.url + "/v1/embeddings", data=json.dumps(
            {"model": model, "input": texts, **body}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.headers["Content-Type"] == "application/octet-stream"
            return r.read(), json.loads(r.headers.get("metadata") or "null")

    for dtype, torch_dtype in views.items():
        want = [torch.tensor(v).to(torch_dtype).view(torch.uint8).numpy().tobytes()
                for v in floats]
        body, meta = post({"encoding_format": "bytes", "embed_dtype": dtype})
        assert body == b"".join(want)
        assert meta["model"] == model and meta["usage"]["prompt_tokens"] > 0
        assert [(d["index"], d["start"], d["end"], d["shape"], d["embed_dtype"])
                for d in meta["data"]] == [
            (i, i * len(want[0]), (i + 1) * len(want[0]), [64], dtype) for i in range(3)]
        status, answer = stack.post("/v1/embeddings", {"model": model, "input": texts,
                                                       "encoding_format": "base64",
                                                       "embed_dtype": dtype})
        assert status == 200 and [base64.b64decode(d["embedding"]) for d in answer["data"]
                                  ] == want
    big, meta = post({"encoding_format": "bytes_only", "endianness": "big"})
    assert meta is None and np.array_equal(np.frombuffer(big, ">f4").reshape(3, 64), floats)


def test_a_clients_request_id_names_the_answer(served):
    """vLLM's request_id (and X-Request-Id, which wins) after the API's prefix; a malformed
    one is a 400."""
    import urllib.request

    client, model, _, stack = served
    r = client.embeddings.create(model=model, input="a", extra_body={"request_id": "job-7"})
    assert r.model_dump()["id"] == "embd-job-7"
    req = urllib.request.Request(stack.url + "/v1/embeddings", data=json.dumps(
        {"model": model, "input": "a", "request_id": "job-7"}).encode(), headers={
        "Content-Type": "application/json", "X-Request-Id": "trace-1"})
    with urllib.request.urlopen(req, timeout=60) as answer:
        assert json.loads(answer.read())["id"] == "embd-trace-1"
    status, ranked = stack.post("/rerank", {"model": model, "query": "a", "documents": ["b"],
                                            "request_id": "r1"})
    assert status == 200 and ranked["id"] == "rerank-r1"
    status, err = stack.post("/v1/embeddings", {"model": model, "input": "a",
                                                "request_id": "has space"})
    assert status == 400 and err["error"]["param"] == "request_id"
