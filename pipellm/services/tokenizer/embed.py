"""The tokenizer's part of an embeddings request (--runner pooling): text inputs to token ids
as the sentence-transformers model would get them (no chat template; the special tokens the
tokenizer adds by default, BOS/EOS as its post-processor says), or chat conversations rendered
with the model's chat template (as vLLM's chat embeddings requests are), then each input
truncated as asked and checked against the context and the vocabulary. A failure is an
EmbedInputError naming its field (a 400); what passes goes to compute as an EmbedRequest of
token ids only."""

from __future__ import annotations

import json
from dataclasses import replace

from pipellm.shared.chat_template import ChatTemplate, ChatTemplateError, template_message
from pipellm.shared.codec import int32s
from pipellm.shared.messages import EmbedRequest


class EmbedInputError(ValueError):
    """An input that cannot be embedded (a 400 on `param`)."""

    def __init__(self, message: str, param: str = "input"):
        super().__init__(message)
        self.param = param


def prepare_embed(tok, req: EmbedRequest, max_model_len: int, vocab_size: int,
                  template: ChatTemplate | None = None) -> EmbedRequest:
    """`req` with `inputs` the token ids of every input (texts tokenized, a pair as the
    tokenizer joins a text pair: a cross-encoder's input; conversations rendered by `template`,
    the model's, then tokenized) and `texts`, `texts_2`, `conversations` None."""
    if req.conversations is not None:
        encodings = tok.encode_batch(render(req, template),
                                     add_special_tokens=req.add_special_tokens)
        inputs = [e.ids for e in encodings]
    elif req.texts is not None:
        texts = req.texts if req.texts_2 is None else list(zip(req.texts, req.texts_2,
                                                               strict=True))
        encodings = tok.encode_batch(texts, add_special_tokens=req.add_special_tokens)
        inputs = [e.ids for e in encodings]
    else:
        inputs = [list(ids) for ids in req.inputs]
    k = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    out = []
    for i, ids in enumerate(inputs):
        if 0 < k < len(ids):
            ids = ids[:k] if req.truncation_side == "right" else ids[-k:]
        check_input(i, ids, max_model_len, vocab_size)
        out.append(int32s(ids))
    return replace(req, inputs=out, texts=None, texts_2=None, conversations=None)


def render(req: EmbedRequest, template: ChatTemplate | None) -> list[str]:
    """Each conversation of `req` as its prompt text."""
    if template is None:
        raise EmbedInputError("this model has no chat template; send texts", "messages")
    extra = json.loads(req.chat_template_kwargs) if req.chat_template_kwargs else None
    try:
        return [template.render([template_message(m) for m in c], req.add_generation_prompt,
                                extra=extra, continue_final=req.continue_final_message)
                for c in req.conversations]
    except ChatTemplateError as e:
        raise EmbedInputError(f"chat template failed: {e}", "messages") from None


def check_input(i: int, ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """EmbedInputError for an input with no tokens, over the context or outside the vocab."""
    if not ids:
        raise EmbedInputError(f"input {i} has no tokens after tokenization")
    if len(ids) > max_model_len:
        raise EmbedInputError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids)} tokens in the input for embedding generation (input {i}). "
            "Please reduce the length of the input, or set truncate_prompt_tokens.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise EmbedInputError(f"input {i} has a token id outside the vocabulary "
                              f"[0, {vocab_size})")
