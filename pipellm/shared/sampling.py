"""Per-request sampling parameters, validated once where a request enters the system."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's and vLLM's limit)

class InvalidParams(ValueError):
    """A sampling parameter is out of range; `param` names it (for OpenAI-style errors)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """What to generate for one request.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    seed None means the engine draws one; the same seed gives the same output.
    """

    max_tokens: int | None = 16  # None: what the context leaves after the prompt (fit_context)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # return each generated token's logprob
    top_logprobs: int = 0  # and the k most likely tokens at each of those positions
    prompt_logprobs: int | None = None  # None: none; k: every prompt token's logprob (but the
    # first's) and the k most likely tokens at its position
    presence_penalty: float = 0.0  # subtract once from every token already generated
    frequency_penalty: float = 0.0  # subtract per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divide (positive) / multiply (negative) logits of tokens
    # seen in prompt or output (the CTRL / HF rule)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]): added to
    # that token's logit before sampling (OpenAI's logit_bias; logprobs stay the model's)
    allowed_token_ids: tuple[int, ...] = ()  # not empty: only these may be sampled
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences the output may not end
    # with: a sequence's last token is banned where the output ends with the rest of it
    beam_width: int = 0  # > 0: beam search with this many beams (pipellm/services/compute/beam/);
    # the sampling fields above but max_tokens, ignore_eos, stop_token_ids, min_tokens and
    # logprobs do not apply
    beam_n: int = 1  # beam search: the best hypotheses returned (<= beam_width)
    length_penalty: float = 1.0  # beam search: a hypothesis scores cum_logprob / len ** this
    early_stopping: bool | str = False  # beam search: True, False or "never" (transformers')
    cache_salt: str = ""  # vLLM's: a prefix cache hit needs the same salt (prompts of other
    # tenants never share KV)
    thinking_budget: int = 0  # > 0: after this many output tokens of reasoning its end marker
    # (thinking_end_ids) is forced, token by token; reasoning starts with the output, or where
    # thinking_start_ids is set, only if the output opens with it (pipellm/shared/reasoning.py's
    # rules). A grammar starts once the end marker has come (compute/structured.ReasoningGate)
    thinking_end_ids: tuple[int, ...] = ()
    thinking_start_ids: tuple[int, ...] = ()
    lora_name: str = ""  # the LoRA adapter to generate with (--lora-modules' name); "": the
    # base model

    def __post_init__(self):
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               "max_tokens must be at least 1")
        _check(self.temperature >= 0, "temperature", "temperature must be >= 0")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "top_k must be -1, 0 or positive")
        _check(0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]")
        _check(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
               "min_tokens must be between 0 and max_tokens")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               "presence_penalty must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               "frequency_penalty must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty",
               "repetition_penalty must be > 0")
        _check(0 <= self.top_logprobs <= MAX_LOGPROBS, "top_logprobs",
               f"top_logprobs must be in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "seed must be in [0, 2^63)")
        _check(self.beam_width >= 0 and 1 <= self.beam_n <= max(self.beam_width, 1),
               "n", "beam search returns between 1 and beam_width hypotheses")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               'early_stopping must be true, false or "never"')
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)  # lists after msgpack
        _check(all(t >= 0 and -100 <= b <= 100 for t, b in bias), "logit_bias",
               "logit_bias maps token ids to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shapes_logits(self) -> bool:
        """Whether its logits are changed before sampling (penalties, logit_bias, banned
        tokens)."""
        return self.reads_output or bool(self.logit_bias or self.allowed_token_ids)

    @property
    def reads_output(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad words, a thinking
        budget): a step cannot be launched before the one in flight is committed, nor drafted
        ahead."""
        return self.has_penalties or bool(self.bad_words_ids) or self.thinking_budget > 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


    def fit_context(self, prompt_len: int, context: int, lower: bool = False) -> SamplingParams:
        """These params with max_tokens resolved against the room a context of `context`
        tokens leaves after the prompt: None becomes the room; with `lower` (a default, not
        the client's own value) a larger one is lowered to it. InvalidParams where the prompt
        and max_tokens (or min_tokens) do not fit."""
        room, n = context - prompt_len, self.max_tokens
        if n is None or lower:
            n = max(min(room, n or room), self.min_tokens, 1)
        if n > room:
            raise InvalidParams(
                "max_tokens", f"This model's maximum context length is {context} tokens. "
                f"However, you requested {prompt_len + n} tokens ({prompt_len} in the prompt, "
                f"{n} for the completion). Please reduce the length of the prompt or max_tokens.")
        return self if n == self.max_tokens else replace(self, max_tokens=n)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParams(param, message)
