"""Speculative decoding with a draft model (`{"model": PATH}`): the draft's KV cache mirrors
the target's slot for slot (pipellm/services/compute/drafter.py), so a draft equal to the target has
every draft accepted whatever moves, preempts or caches the segments; a different draft gives
the same tokens as plain decoding (greedy and seeded); the reference model drafts for itself
token-exactly; through the real services with the official client."""

from __future__ import annotations

import json

import pytest

from pipellm.shared.sampling import SamplingParams
from pipellm.shared.speculative import SpeculativeConfig
from tests.hf_models import build_hf_model
from tests.test_architectures import engine, greedy
from tests.test_speculative import run, served_equals_plain, tiny  # noqa: F401 (a fixture)


def draft_spec(path, k: int = 3, **kw) -> str:
    return json.dumps({"model": str(path), "num_speculative_tokens": k,
                       "disable_by_batch_size": 64, **kw})


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, tiny):  # noqa: F811
    """A different tiny model over the same vocabulary: one layer, other weights."""
    path = tmp_path_factory.mktemp("draft")
    build_hf_model(path, "llama", seed=1, initializer_range=0.1, num_hidden_layers=1)
    return path


@pytest.mark.parametrize(("text", "needle"), [
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 3}', "method"),
])
def test_method_and_model_must_agree(text, needle):
    with pytest.raises(ValueError, match=needle):
        SpeculativeConfig.parse(text)
    spec = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}')
    assert (spec.method, spec.model) == ("draft_model", "/m")


@pytest.mark.parametrize("settings", [
    dict(max_batched_tokens=64, max_running=8),  # chunked prefill beside verifies
    dict(max_batched_tokens=64, max_running=8, kv_cache_tokens=700, default_predicted_len=2,
         kv_min_grow=4),  # preemption, and segments moved
    dict(max_batched_tokens=512, max_running=8, enable_prefix_caching=True),
    dict(max_batched_tokens=64, max_running=8, kv_cache_dtype="int8"),
], ids=["chunked", "preempted", "prefix-cached", "int8-kv"])
def test_the_target_as_its_own_draft_has_its_drafts_accepted(tiny, settings):  # noqa: F811
    """Were the draft's cache out of step with the target's anywhere (a move, a preemption,
    a prefix-cache copy), its proposals would differ from the target's tokens there."""
    path, prompts = tiny
    want, _ = run(path, prompts, greedy(40), **settings)
    got, stats = run(path, prompts, greedy(40), speculative_config=draft_spec(path),
                     **settings)
    assert got == want
    assert stats.spec_draft_tokens > 100
    # a batch of other shape may round a near-tie the other way, rarely
    assert stats.spec_accepted_tokens >= 0.97 * stats.spec_draft_tokens
    if "kv_cache_tokens" in settings:
        assert stats.preemptions > 0


def test_a_different_draft_gives_plain_decodings_tokens(tiny, other_draft):  # noqa: F811
    path, prompts = tiny
    want, _ = run(path, prompts, greedy(40), max_batched_tokens=64, max_running=8)
    got, stats = run(path, prompts, greedy(40), max_batched_tokens=64, max_running=8,
                     speculative_config=draft_spec(other_draft, k=4))
    assert got == want and stats.spec_draft_tokens > 0


def test_seeded_sampling_draws_what_plain_decoding_draws(tiny):  # noqa: F811
    """The draft's greedy tokens are accepted where the target's seeded sample equals them."""
    path, prompts = tiny
    params = [SamplingParams(max_tokens=30, temperature=t, top_p=0.9, seed=s)
              for s, t in enumerate((0.3, 0.6, 1.0, 0.3, 0.6, 1.0))]
    want, _ = run(path, prompts, params, max_batched_tokens=64, max_running=8)
    got, stats = run(path, prompts, params, max_batched_tokens=64, max_running=8,
                     speculative_config=draft_spec(path))
    assert got == want and stats.spec_accepted_tokens > 0


def test_smollm2_drafting_for_itself_is_token_exact():
    """The reference model (Q4 blocks, INT8 activations) as its own draft: the same greedy
    tokens as plain decoding, and its drafts accepted."""
    from pipellm.shared import default_model
    from pipellm.shared.chat_template import load_chat_template
    from pipellm.shared.tokenizer import load_tokenizer

    path = default_model.fetch()
    tok, template = load_tokenizer(path), load_chat_template(path)
    prompts = [template.encode(tok, [{"role": "user", "content": q}]) for q in (
        "What is the capital of France?", "Write a haiku about the sea.")]
    want, _ = run(path, prompts, greedy(24), max_batched_tokens=256, max_running=4)
    got, stats = run(path, prompts, greedy(24), max_batched_tokens=256, max_running=4,
                     speculative_config=draft_spec(path))
    assert got == want
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens > 0, stats


def test_a_draft_with_another_vocabulary_is_refused(tiny, tmp_path):  # noqa: F811
    path, _ = tiny
    build_hf_model(tmp_path, "llama", num_hidden_layers=1, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        engine(path, speculative_config=draft_spec(tmp_path))


def test_served_with_a_draft_model(demo_model_dir):
    """`pipellm up --speculative-config '{"model": ...}'` (real processes, real Redis):
    greedy completions, streamed and not, equal the plain engine's text, and /metrics counts
    accepted drafts."""
    values = served_equals_plain(demo_model_dir, draft_spec(demo_model_dir), "Once upon a time")
    assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
