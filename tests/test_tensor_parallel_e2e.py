"""`pipellm serve --tensor-parallel-size 2` (services/compute/tp/) through the real services and
the official client: the compute process is rank 0 and starts rank 1."""

from __future__ import annotations

import openai

from shared.sampling import SamplingParams
from tests.hf_models import build_hf_model
from tests.stack import Stack
from tests.test_tensor_parallel import PROMPTS, assert_same, engine, generate


def test_served_to_the_official_client(tmp_path):
    """`pipellm serve --tensor-parallel-size 2`: the compute process is rank 0; completions
    (a batch of token-id prompts, and streamed) carry the tokens and logprobs of one rank
    run offline."""
    build_hf_model(tmp_path, "llama", with_tokenizer=True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    expected = generate(engine(tmp_path, 1), PROMPTS, params)
    stack = Stack(tmp_path, "--served-model-name", "m", "--tensor-parallel-size", "2",
                  "--dtype", "float32", "--threads", "1").start(timeout_s=180)
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="m", max_tokens=10, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        answer = client.completions.create(prompt=PROMPTS, **kw)
        streamed = [c.choices[0] for c in client.completions.create(prompt=PROMPTS[3],
                                                                      stream=True, **kw)]
    finally:
        stack.stop()
    choices = sorted(answer.choices, key=lambda c: c.index)
    served = [(c.token_ids, c.logprobs.token_logprobs, []) for c in choices]
    assert_same(expected, served)
    assert [t for c in streamed for t in c.token_ids] == expected[3][0]
