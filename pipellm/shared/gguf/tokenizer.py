"""A `tokenizers.Tokenizer` built from a GGUF file's `tokenizer.ggml.*` metadata.

Supported: `tokenizer.ggml.model = gpt2` (byte-level BPE: tokens are already spelled in GPT-2's
byte alphabet, merges are "a b" strings). The text is split before BPE the way llama.cpp splits
it for the file's `tokenizer.ggml.pre`; control tokens (type 3) become special added tokens,
user-defined ones (type 4) plain added tokens, both matched whole in the text. BOS/EOS are added
only when `tokenizer.ggml.add_bos_token` / `add_eos_token` say so (llama.cpp's rule).
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pipellm.shared.gguf.reader import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer split expressions by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp has them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    # digits one by one, then GPT-2's expression (SmolLM's own tokenizer.json: Digits + ByteLevel)
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The file's tokenizer; raises GGUFError when its kind is not supported."""
    kind = gguf.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{gguf.path}: tokenizer model {kind!r} is not supported (only 'gpt2', "
                        "byte-level BPE)")
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in _SPLITS:
        raise GGUFError(f"{gguf.path}: pre-tokenizer {pre!r} is not supported (supported: "
                        f"{', '.join(sorted(_SPLITS))})")
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_marked_tokens(tok, tokens, gguf.get("tokenizer.ggml.token_type") or [])
    post = _post_processor(gguf, tokens)
    if post is not None:
        tok.post_processor = post
    return tok


def _add_marked_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (both
    keep their ids: they are already in the vocabulary)."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=False) if k == CONTROL]
    plain = [AddedToken(t, special=False, normalized=False)
             for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)


def _post_processor(gguf: GGUFFile, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS before / EOS after the text when the file asks for them; None when it adds neither."""
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return None
    single, special = ["$A"], []
    for key, wanted, at in (("bos", add_bos, 0), ("eos", add_eos, None)):
        if wanted:
            token_id = gguf.require(f"tokenizer.ggml.{key}_token_id")
            single.insert(len(single) if at is None else at, tokens[token_id])
            special.append((tokens[token_id], token_id))
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
