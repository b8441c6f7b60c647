"""A /score or /rerank request's pairs as one EmbedRequest, and its EmbedResult as their scores.

- A model with a head (pipellm/shared/scoring.py) is a cross-encoder: each (text_1, text_2) pair is
one
  input of task "classify" (the texts as the tokenizer joins a text pair; for a Qwen3-Reranker,
  `is_original_qwen3_reranker`, one prompt in its documented format, no special tokens); the
  score is the sigmoid of the head's logit at the last token.
- An embedding model (no head) is a bi-encoder, as vLLM scores one: each text is embedded once
  (task "embed": text_1, once when it is shared by every pair, then every text_2) and a pair's
  score is the cosine similarity of its two embeddings.
`truncate_pairs` first cuts each side's texts to the request's max_tokens_per_query /
max_tokens_per_doc tokens (as vLLM does: the text up to where the next token would start).
The gateway (score_api.py) and run-batch (run_batch_pooling.py) both use these.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from tokenizers import Tokenizer

from pipellm.services.gateway.score_request import PairsRequest
from pipellm.shared.messages import EmbedRequest, EmbedResult
from pipellm.shared.scoring import RERANKER_INSTRUCTION, ScoringConfig, reranker_prompt

EPS = 1e-8  # the norms' floor in the cosine (torch.nn.functional.cosine_similarity's)


def pairs_message(req: PairsRequest, scoring: ScoringConfig, request_id: str,
                  reply_to: str) -> EmbedRequest:
    """The one EmbedRequest that scores every pair of `req` on a model scoring as `scoring`."""
    common = {"truncate_prompt_tokens": req.truncate_prompt_tokens,
              "truncation_side": req.truncation_side}
    if not scoring.scores:
        return EmbedRequest(request_id, reply_to, texts=_firsts(req) + [b for _, b in req.pairs],
                            task="embed", **common)
    if scoring.qwen3_template:
        return EmbedRequest(request_id, reply_to, task="classify", add_special_tokens=False,
                            texts=[reranker_prompt(a, b, req.instruction or RERANKER_INSTRUCTION)
                                   for a, b in req.pairs], **common)
    return EmbedRequest(request_id, reply_to, task="classify", texts=[a for a, _ in req.pairs],
                        texts_2=[b for _, b in req.pairs], **common)


def pair_scores(req: PairsRequest, scoring: ScoringConfig, result: EmbedResult) -> list[float]:
    """Each pair's score, in pair order, from the EmbedResult of `pairs_message`."""
    if scoring.scores:
        return [sigmoid(x) if req.use_activation else x for x in result.vectors]
    rows = np.frombuffer(result.vectors, dtype=np.float32).reshape(-1, result.dim)
    rows = rows.astype(np.float64)
    n = len(_firsts(req))
    firsts, seconds = rows[:n], rows[n:]
    if n == 1:
        firsts = np.repeat(firsts, len(seconds), axis=0)
    norms = (np.maximum(np.linalg.norm(firsts, axis=1), EPS)
             * np.maximum(np.linalg.norm(seconds, axis=1), EPS))
    return ((firsts * seconds).sum(axis=1) / norms).tolist()


def truncate_pairs(req: PairsRequest, tok: Tokenizer) -> PairsRequest:
    """`req` with each pair's first text cut to max_tokens[0] tokens and its second to
    max_tokens[1] (0: as it is)."""
    if req.max_tokens == (0, 0):
        return req
    cut = [{t: cut_text(tok, t, k) for t in {p[side] for p in req.pairs}} if k else None
           for side, k in enumerate(req.max_tokens)]
    pairs = tuple(tuple(t if c is None else c[t] for t, c in zip(p, cut, strict=True))
                  for p in req.pairs)
    return replace(req, pairs=pairs)


def cut_text(tok: Tokenizer, text: str, k: int) -> str:
    """`text` up to where its (k+1)-th token starts (no special tokens): what tokenizes to its
    first k tokens; cut again while BPE merges across the new end leave more than k."""
    while text:
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= k:
            break
        end = min(enc.offsets[k - 1][1], enc.offsets[k][0])
        text = text[:min(end, len(text) - 1)]
    return text


def _firsts(req: PairsRequest) -> list[str]:
    """The text_1 texts a bi-encoder embeds: the one shared text once, else every pair's."""
    if req.shared_first:
        return [req.pairs[0][0]]
    return [a for a, _ in req.pairs]


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)
