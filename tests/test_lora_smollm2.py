"""LoRA adapters (issue 49) on the reference real model, SmolLM2-135M-Instruct (its GGUF, in
float32: `--quantization none`): two random PEFT adapters of it, built here on transformers' own
load of the same file (A rank 8 on every projection; B rank 16, rsLoRA, on q, v and down), give
the greedy tokens of PEFT's `merge_and_unload()` of each, through LLMEngine (each alone and all
in one batch with the base) and through the served API with the official openai client."""

from __future__ import annotations

import copy

import openai
import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.stack import Stack
from tests.test_lora import ALL
from tests.test_smollm2 import MAX_NEW, gguf_path, hf, hf_greedy, prompts  # noqa: F401

ADAPTERS = {"A": (8, 16, False, ALL, 1), "B": (16, 8, True, ["q_proj", "v_proj", "down_proj"], 2)}


@pytest.fixture(scope="module")
def few(prompts):  # noqa: F811
    """Two chat prompts and two completions."""
    return prompts[::2]


@pytest.fixture(scope="module")
def adapters(hf, few, tmp_path_factory):  # noqa: F811
    """({name: adapter dir}, {"" and each name: transformers' greedy tokens per prompt})."""
    from peft import LoraConfig, get_peft_model

    root, dirs = tmp_path_factory.mktemp("smol-lora"), {}
    expected = {"": [hf_greedy(hf[0], p) for p in few]}
    for name, (rank, alpha, rslora, targets, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(hf[0]), LoraConfig(
            r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
            lora_dropout=0.0))
        with torch.no_grad():  # B is zeros at init: random, so the adapter changes the output
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5 / rank ** 0.5)
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        merged = model.merge_and_unload().eval()
        expected[name] = [hf_greedy(merged, p) for p in few]
    assert expected["A"] != expected[""] and expected["B"] != expected[""]
    return dirs, expected


def _modules(dirs) -> str:
    return " ".join(f"{n}={d}" for n, d in dirs.items())


def test_engine_gives_each_adapter_the_merged_models_tokens(gguf_path, few, adapters):  # noqa: F811
    dirs, expected = adapters
    engine = build_engine(with_settings(
        EngineConfig(), model=str(gguf_path), kv_cache_tokens=4096, quantization="none",
        dtype="float32", enable_lora=True, lora_modules=_modules(dirs), max_loras=2))
    names = [n for n in expected for _ in few]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, lora_name=n) for n in names]
    seqs = engine.generate(few * len(expected), params)  # one mixed batch
    got = [s.output_ids for s in seqs]
    assert got == [t for n in expected for t in expected[n]]


def test_served_adapters_answer_as_the_merged_models(gguf_path, hf, few, adapters):  # noqa: F811
    dirs, expected = adapters
    stack = Stack(gguf_path, "--kv-cache-tokens", "4096", "--quantization", "none", "--dtype",
                  "float32", "--enable-lora", "--lora-modules", *(f"{n}={d}" for n, d in
                                                                   dirs.items()),
                  "--max-loras", "2").start(timeout_s=180)
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0)
        for name in dirs:
            for prompt, want in zip(few, expected[name], strict=True):
                r = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW,
                                              temperature=0)
                assert r.choices[0].text == hf[1].decode(want, skip_special_tokens=True)
    finally:
        stack.stop()
