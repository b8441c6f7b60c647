"""LoRA adapters under tensor parallelism (`--enable-lora --lora-modules` with
`--tensor-parallel-size 2`): each rank applies its slice of every adapter (B's rows of q/k/v and
gate/up, A's columns of o and down: tp/shard.shard_factors), o's and down's deltas all-reduced
with the base's partial sums. Through `LLMEngine` against one rank, float32: a batch mixing
the base and two adapters (one of every projection, one of q, v and down at another rank),
chunked prefill, then an adapter loaded and one unloaded at run time (every rank told:
tp/step.AdapterChange; one that cannot be read refused alike): greedy tokens identical,
generated and prompt logprobs within 1e-4 (float base layers; INT4 ones within
test_tensor_parallel's W4A8_TOL, FP8 ones within QUANT_TOL)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipellm.shared.lora import LoraError, LoraModule
from pipellm.shared.sampling import SamplingParams
from tests.hf_models import build_hf_model
from tests.test_lora import ADAPTERS, build_adapter
from tests.test_tensor_parallel import (  # noqa: F401  (the fixtures)
    PROMPTS,
    TOL,
    W4A8_TOL,
    _keep_torch_threads,
    assert_same,
    generate,
    on_both,
)
from tests.test_tensor_parallel_quantized import QUANT_TOL


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """(base dir, {adapter name: dir}): a tiny Llama of 2 KV heads and test_lora's adapters."""
    root = tmp_path_factory.mktemp("tp-lora")
    build_hf_model(root / "base", "llama", initializer_range=0.1, num_key_value_heads=2)
    dirs = {name: root / name for name in ADAPTERS}
    for name, args in ADAPTERS.items():
        build_adapter(root / "base", dirs[name], *args)
    return root / "base", dirs


# not w8a8 here: its SmoothQuant factors, calibrated on the ranks' float model, differ from one
# rank's in their last bits, and on this model that moves a smoothed weight across an INT8
# rounding step, enough for adapter A to take another greedy token
@pytest.mark.parametrize(("quantization", "tol"), [("none", TOL), ("int4", W4A8_TOL),
                                                   ("fp8", QUANT_TOL)])
def test_adapters_on_two_ranks_match_one(lora_model, quantization, tol):
    """int4: the adapters beside INT4 base layers (a rank's columns of o and down whole
    groups); fp8: beside o and down quantized with the whole rows' scales, their deltas summed
    with the base's partial sums."""
    base, dirs = lora_model
    names = ["", "A", "B", "A", "B", "", "B", "A"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True,
                             prompt_logprobs=0, lora_name=n or None) for n in names]
    modules = " ".join(f"{n}={d}" for n, d in dirs.items())

    def run(eng):
        """The mixed batch; then adapter C (A's files) loaded, B unloaded, and C's requests."""
        out = generate(eng, prompts, params)
        eng.adapters.load(LoraModule("C", str(dirs["A"])))
        eng.unload_lora("B")
        with pytest.raises(LoraError):  # refused alike on every rank
            eng.adapters.load(LoraModule("D", str(dirs["A"].parent / "missing")))
        later = [replace(params[1], lora_name="C"), params[0]]
        return out + generate(eng, [prompts[1], prompts[0]], later)
    one, two = on_both(base, run, enable_lora=True, lora_modules=modules, max_loras=2,
                       max_lora_rank=16, quantization=quantization)
    assert_same(one, two, tol)
    assert one[1][0] != one[5][0]  # prompt 1 with adapter A and without: A changes it
    assert one[-2][0] == one[1][0]  # C is A (its slot after B's was dropped)
