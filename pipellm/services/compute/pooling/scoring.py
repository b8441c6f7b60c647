"""Scoring heads over the pooled last-token hidden state (pipellm/shared/scoring.py says which).

- A sequence classification head (`*ForSequenceClassification`, `--convert classify`): the
  checkpoint's `score.weight` [num_labels, hidden] times the final-normed hidden state of each
  prompt's last token (HF's rule for decoder classifiers: the last non-pad token). Out: the
  num_labels logits; the gateway turns them into probabilities.
- A yes/no reranker (vLLM's `classifier_from_token`, Qwen3-Reranker): `yes_no_rows` puts the
  LM head's rows of the (no, yes) tokens in the weights as `score.weight` [2, hidden] before
  the model is built (as vLLM converts it), so a step never computes the vocabulary's logits;
  out: logit[yes] - logit[no] (after Gemma's soft cap, where the model has one), whose sigmoid
  is the score.
"""

from __future__ import annotations

import torch

from pipellm.services.compute.pooling.embedder import embed
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.sampling import InvalidParams
from pipellm.shared.scoring import YES_NO, ScoringConfig
from pipellm.shared.tokenizer import load_tokenizer

LAST = PoolingConfig(mode="last", normalize=False)
SCORE = "score.weight"


def yes_no_rows(scoring: ScoringConfig, model_path: str,
                weights: dict[str, torch.Tensor], rows=None) -> None:
    """A yes/no reranker's `score.weight`: its LM head's (or tied embedding's) rows of the
    (no, yes) tokens, added to `weights` (nothing for other models); ValueError when a token is
    not one token of the vocabulary or the head is not a float matrix. `rows(head, ids)`: the
    whole head's rows `ids` where `weights` hold a part of it (a tensor-parallel rank's)."""
    if scoring.kind != YES_NO:
        return
    tok = load_tokenizer(model_path)
    ids = [tok.token_to_id(t) for t in scoring.tokens]
    missing = [t for t, i in zip(scoring.tokens, ids, strict=True) if i is None]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} not a token of the vocabulary")
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    if not isinstance(head, torch.Tensor) or not head.is_floating_point():
        raise ValueError("a yes/no reranker needs a float LM head (not GGUF int4 blocks)")
    if rows is not None:
        weights[SCORE] = rows(head, ids)
        return
    if max(ids) >= head.shape[0]:
        raise ValueError(f"classifier_from_token ids {ids} outside the LM head's "
                         f"{head.shape[0]} rows")
    weights[SCORE] = head[ids].clone()


class ScoringHead:
    """The model's head over pooled rows: [N, hidden] -> [N, k] float32 logits (k: the
    classifier's labels, or 1 for a yes/no reranker)."""

    def __init__(self, model, scoring: ScoringConfig, final_softcap: float = 0.0):
        self.scoring, self.softcap = scoring, final_softcap
        self.weight = getattr(model, "score", None)
        if not scoring.scores:
            return
        if self.weight is None:
            raise ValueError(f"the checkpoint has no {SCORE}: it is not a sequence "
                             "classifier (serve it with --runner pooling for embeddings)")
        rows = 2 if scoring.kind == YES_NO else scoring.num_labels
        if self.weight.shape[0] != rows:
            raise ValueError(f"{SCORE} has {self.weight.shape[0]} rows, the config "
                             f"{rows} labels")
        self.weight = self.weight.float()

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = pooled.float() @ self.weight.T
        if self.scoring.kind != YES_NO:
            return logits
        if self.softcap:  # Gemma 2: the logits are capped before they are compared
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits[:, 1] - logits[:, 0]).unsqueeze(1)


def classify(engine, prompts: list[list[int]], head: ScoringHead) -> torch.Tensor:
    """[len(prompts), k] float32 logits of `head` over each prompt's last token (batched and
    checked as `embed` does); InvalidParams on `model` for a model without a head."""
    if not head.scoring.scores:
        raise InvalidParams("model", "this model has no scoring head (an embedding model): "
                            "serve a sequence classification or yes/no reranker model")
    return embed(engine, prompts, LAST, head=head)
