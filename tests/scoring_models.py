"""Tiny random scoring models saved to disk, as reference implementations for tests: a Qwen3
sequence classifier (a cross-encoder with num_labels=1) and a Qwen3 causal LM served as a
Qwen3-Reranker-style yes/no reranker (vLLM's --hf-overrides)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tests.hf_models import ARCH_DEFAULTS, DEFAULTS, build_hf_model, demo_tokenizer

# the demo vocabulary has no "yes" / "no": the reranker's (no, yes) tokens are two it has
YES_NO_TOKENS = ["N", "Y"]
YES_NO_OVERRIDES = json.dumps({"architectures": ["Qwen3ForSequenceClassification"],
                               "classifier_from_token": YES_NO_TOKENS,
                               "is_original_qwen3_reranker": True})


def _tokenizer_files(path: Path) -> None:
    demo_tokenizer().save(str(path / "tokenizer.json"))
    # padding (CrossEncoder's batches) needs a pad token; the classifier skips pads
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "</s>"}))


def build_classifier(path: Path, num_labels: int, seed: int = 3
                     ) -> transformers.Qwen3ForSequenceClassification:
    """A tiny random Qwen3ForSequenceClassification with the demo tokenizer at `path`."""
    tok = demo_tokenizer()
    eos = tok.token_to_id("</s>")
    fields = {**DEFAULTS, **ARCH_DEFAULTS["qwen3"], "vocab_size": tok.get_vocab_size(),
              "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": eos,
              "pad_token_id": eos, "num_labels": num_labels, "initializer_range": 0.2}
    torch.manual_seed(seed)
    model = transformers.Qwen3ForSequenceClassification(
        transformers.Qwen3Config(**fields)).eval()
    model.save_pretrained(path)
    _tokenizer_files(path)
    return model


def build_yes_no(path: Path, seed: int = 4) -> transformers.PreTrainedModel:
    """A tiny random Qwen3 causal LM with the demo tokenizer at `path`."""
    model = build_hf_model(path, "qwen3", with_tokenizer=True, initializer_range=0.2,
                           seed=seed)
    _tokenizer_files(path)
    return model


@torch.inference_mode()
def yes_no_reference(model, ids: list[list[int]]) -> list[float]:
    """sigmoid(logit[yes] - logit[no]) at each prompt's last token, by transformers."""
    tok = demo_tokenizer()
    no, yes = (tok.token_to_id(t) for t in YES_NO_TOKENS)
    out = []
    for p in ids:
        logits = model(torch.tensor([p])).logits[0, -1]
        out.append(torch.sigmoid(logits[yes] - logits[no]).item())
    return out


@torch.inference_mode()
def classifier_logits(model, ids: list[list[int]]) -> torch.Tensor:
    """[N, num_labels] logits of each prompt alone (no padding), by transformers."""
    return torch.cat([model(torch.tensor([p])).logits for p in ids])
