"""Typed messages, one group per channel. All travel through `pipellm.shared.codec`.

    gateway --TokenizeRequest--> tokenizer --GenerateRequest--> compute --StepOutput--> detokenizer
    detokenizer --DeltaBatch--> gateway (the one named in the request's route)
    gateway --Abort--> compute control        detokenizer --Abort(reason="stop")--> compute control
    gateway --LoraUpdate--> every compute's control (adapters loaded / unloaded at run time)
    tokenizer --DeltaBatch (error)--> gateway
    --runner pooling: gateway --EmbedRequest (texts or ids)--> tokenizer --EmbedRequest (ids)-->
    compute --EmbedResult--> gateway (the one in reply_to; a tokenizer's refusal too)

Token id fields hold `array('i')` (packed int32 on the wire); build them with `codec.int32s`.
"""

from __future__ import annotations

from array import array
from dataclasses import field

from pipellm.shared.codec import message, register
from pipellm.shared.grammar import GrammarSpec
from pipellm.shared.sampling import SamplingParams

register(SamplingParams)


@message
class ToolCallMsg:
    """A tool call of an assistant message in the history (OpenAI's shape, flattened)."""

    id: str
    name: str
    arguments: str  # JSON text, as the client sent it


@message
class ChatMessage:
    role: str
    content: str
    tool_calls: list[ToolCallMsg] = field(default_factory=list)  # assistant: the calls it made
    tool_call_id: str | None = None  # role "tool": the call this message answers
    name: str | None = None
    reasoning: str | None = None  # assistant: its reasoning, as a reasoning parser split it


@message
class ToolSpec:
    """A function the model may call: what the chat template renders (`tools=`)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'  # JSON schema, as JSON text


# --- gateway -> tokenizer -------------------------------------------------------------------

@message
class Resume:
    """A choice to continue after a restart of compute, the detokenizer or a tokenizer lost
    it: its next attempt and what its client already has (pipellm.shared.choice.ChoiceId names
    it)."""

    index: int
    attempt: int  # >= 1
    output_ids: array  # int32, the tokens already streamed
    sent_chars: int  # characters of text already streamed

@message
class TokenizeRequest:
    """One API request as the gateway validated it; n > 1 fans out in the tokenizer."""

    request_id: str
    reply_to: str  # address of the gateway that owns the request
    params: SamplingParams
    prompt_text: str | None = None
    prompt_ids: array | None = None  # int32
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    stop: list[str] = field(default_factory=list)
    n: int = 1  # choices of this prompt
    prompt_index: int = 0  # batched prompts: its place; its choices are prompt_index * n + j
    num_prompts: int = 1  # prompts of the API request (each its own TokenizeRequest)
    max_tokens_auto: bool = False  # no max_tokens given: generate up to the context length
    arrival: float = 0.0  # gateway wall clock (time.time())
    resume: list[Resume] = field(default_factory=list)  # not empty: only these choices, resumed
    grammar: GrammarSpec | None = None  # structured output: the constraint (checked here)
    tools: list[ToolSpec] | None = None  # chat: rendered by the chat template (tools=)
    chat_template_kwargs: str = ""  # chat: a JSON object of extra template variables
    chat_template: str = ""  # chat: the request's own template ("": the model's)
    add_special_tokens: bool | None = None  # the tokenizer's special tokens (BOS) added to the
    # prompt text (None: a text prompt's yes, a chat's no: its template writes them)
    continue_final_message: bool = False  # chat: the prompt ends inside the last message
    truncate_prompt_tokens: int = 0  # > 0: keep only this many prompt tokens (the last ones
    # with truncation_side "left", the first with "right")
    truncation_side: str = "left"
    include_stop_str_in_output: bool = False  # the detokenizer's (Route's)
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # the prompt's ids come back with the first delta
    bad_words: list[str] = field(default_factory=list)  # tokenized into params.bad_words_ids
    reasoning_parser: str = ""  # chat: the detokenizer splits reasoning off
                                # (pipellm/shared/reasoning)
    thinking_token_budget: int = 0  # with a reasoning parser: its end forced after this many
    # reasoning tokens (compute, SamplingParams.thinking_budget)
    priority: int = 0  # lower is served first (--scheduling-policy priority or predicted)

    @property
    def first_choice(self) -> int:
        """The API request's index of this prompt's first choice."""
        return self.prompt_index * self.n


# --- tokenizer -> compute -------------------------------------------------------------------

@message
class Route:
    """What the detokenizer needs to stream a request back; compute passes it through."""

    request_id: str
    reply_to: str
    num_prompt: int
    prompt_tail: array  # int32, last prompt tokens: context for incremental detokenization
    stop: list[str] = field(default_factory=list)
    n: int = 1  # choices of the API request this one belongs to
    length_features: list[int] = field(default_factory=list)  # the predictor learns at finish
    prompt_ids: array | None = None  # int32, the whole prompt: with prompt logprobs, or asked
    scores_prompt: bool = False  # prompt logprobs asked for (the first delta carries them)
    resume: Resume | None = None  # a resumed choice: the detokenizer replays its outputs
    cached_tokens: int = 0  # set by compute at admission: prompt tokens a prefix cache hit gave
    include_stop_str_in_output: bool = False  # a matched stop string ends the text
    skip_special_tokens: bool = True  # special tokens are left out of the text
    reasoning_parser: str = ""  # the output's reasoning goes to Delta.reasoning
                                # (pipellm/shared/reasoning)


@message
class GenerateRequest:
    request_id: str  # "<api id>:<choice index>"
    prompt_ids: array  # int32
    params: SamplingParams
    route: Route
    predicted_length: list[int] | None = None  # its quantiles at length_dist.LEVELS
    output_ids: array = field(default_factory=lambda: array("i"))  # int32: a resumed choice's
    # tokens so far (they follow the prompt and count as output)
    grammar: GrammarSpec | None = None  # structured output: compiled by compute
    routed_tokens: int = 0  # KV tokens routing added to its compute's `pending` demand (DP)
    priority: int = 0  # the API request's: lower is served first (scheduling/policy.py)

    @property
    def prefill_tokens(self) -> int:
        """Tokens compute prefills for it: the prompt, and a resumed choice's output so far."""
        return len(self.prompt_ids) + len(self.output_ids)


# --- gateway / detokenizer -> compute control -----------------------------------------------

@message
class Abort:
    """Stop a request: the client left ("abort") or a stop string matched ("stop")."""

    request_id: str
    reason: str = "abort"


@message
class LoraUpdate:
    """Load the LoRA adapter at `path` as `name` (the gateway checked it), or with no path
    unload it: to every compute (`--allow-runtime-lora-updating`)."""

    name: str
    path: str = ""


# --- compute -> detokenizer -----------------------------------------------------------------

@message
class Tokens:
    """Consecutive tokens of one request and what compute computed about them: the one record
    a token's result travels in, from the engine's step through the detokenizer to the gateway
    (which turns it into OpenAI's shape).

    Row i is token_ids[i], at position start + i of the request's tokens (prompt, then
    output); its logprob given the tokens before it; then the k most likely tokens at that
    position, best first (k = 0 unless the request asked for them). finish_reason: why the
    request ends with the last row (output tokens only; None while it goes on)."""

    request_id: str
    start: int
    token_ids: array  # int32 [n]
    logprobs: array  # float32 [n]
    top_ids: array = field(default_factory=lambda: array("i"))  # int32 [n * k], row-major
    top_logprobs: array = field(default_factory=lambda: array("f"))  # float32 [n * k]
    finish_reason: str | None = None
    ranks: array = field(default_factory=lambda: array("i"))  # int32 [n], prompt rows only:
    # each token's rank in its row's distribution (1: the most likely), as vLLM reports it

    @property
    def k(self) -> int:
        return len(self.top_ids) // max(len(self.token_ids), 1)

    def extend(self, other: Tokens) -> None:
        """Append the record that follows this one (the same request's next positions)."""
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
            getattr(self, name).extend(getattr(other, name))
        self.finish_reason = other.finish_reason


@message
class RequestError:
    """A request compute refused (its parameters, its grammar): the client's 400."""

    request_id: str
    reply_to: str
    message: str
    param: str | None = None  # the request field it is about


@message
class StepOutput:
    """Everything one engine step produced."""

    routes: list[Route]  # requests admitted this step (their first output follows)
    outputs: list[Tokens] = field(default_factory=list)  # one per request that got a token
    prompt: list[Tokens] = field(default_factory=list)  # scored prompt pieces, by chunk
    errors: list[RequestError] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # requests ended by an Abort
    step_time: float = 0.0  # wall clock when the step finished


# --- detokenizer / tokenizer -> gateway -----------------------------------------------------

@message
class Delta:
    """New output of one request (one choice). Final when finish_reason is set or error is."""

    request_id: str
    text: str = ""
    tokens: Tokens | None = None  # the output tokens this delta adds, as compute sent them
    finish_reason: str | None = None
    num_prompt: int = 0
    num_output: int = 0
    error: str | None = None
    error_status: int = 0  # HTTP status for errors (400: bad request, 503: service)
    error_param: str | None = None  # the request field a 400 is about
    started_at: float = 0.0  # on a choice's first delta: wall clock when compute admitted it
    cached_tokens: int = 0  # on a choice's first delta: its prompt tokens from the prefix cache
    prompt_ids: array | None = None  # on the first delta, with prompt logprobs: the prompt
    prompt: Tokens | None = None  # and its tokens' logprobs, from position 1
    reasoning: str = ""  # with a reasoning parser: new reasoning text (before `text`'s)
    stop_string: str | None = None  # on the final delta: the stop string that ended it

    @property
    def token_ids(self) -> array:
        return self.tokens.token_ids if self.tokens is not None else array("i")

    @property
    def logprobs(self) -> array:
        return self.tokens.logprobs if self.tokens is not None else array("f")


@message
class DeltaBatch:
    deltas: list[Delta]


# --- the pooling runner: gateway -> tokenizer -> compute -> gateway --------------------------

@message
class EmbedRequest:
    """One /v1/embeddings, /pooling, /score, /rerank or /classify request (--runner pooling).
    From the gateway it holds `texts` (and `texts_2`, pairs), `conversations` or `inputs`; the
    tokenizer sends it on to compute with `inputs` only: each input's token ids (special
    tokens added, truncated, checked against the context and the vocabulary)."""

    request_id: str
    reply_to: str  # address of the gateway that owns the request
    inputs: list[array] = field(default_factory=list)  # int32 token ids, one array per input
    texts: list[str] | None = None  # text inputs, tokenized by the tokenizer
    dimensions: int = 0  # > 0: Matryoshka truncation to this width
    truncate_prompt_tokens: int = 0  # > 0: keep this many of each input's tokens; -1: the
    # context length's
    truncation_side: str = "right"  # which end truncation keeps: "right" the first tokens (the
    # pooling runner's default, vLLM's and sentence-transformers'), "left" the last
    add_special_tokens: bool = True  # texts: the tokenizer's special tokens (BOS/EOS) added
    task: str = "embed"  # "embed": pooled vectors; "classify": the scoring head's logits (the
    # last token's; /score, /rerank, /classify), num_labels a row (1 for a yes/no reranker);
    # "reward": every token's reward head output (--convert reward's /pooling), a row per token
    texts_2: list[str] | None = None  # pairs: texts[i] tokenized with texts_2[i] as its pair
    use_activation: bool | None = None  # task embed: L2-normalize (None: as the model does)
    conversations: list[list[ChatMessage]] | None = None  # chat inputs, rendered by the
    # tokenizer with the model's chat template (instead of texts)
    add_generation_prompt: bool = False  # conversations: how they render (vLLM's defaults)
    continue_final_message: bool = False
    chat_template_kwargs: str = ""  # a JSON object of extra template variables


@message
class EmbedResult:
    """The answer to an EmbedRequest: its vectors, row-major float32 [len(num_tokens), dim]
    ([sum(num_tokens), dim] for task reward: a row per token, input after input), and each
    input's token count; or an error (a 400 names its field in error_param)."""

    request_id: str
    vectors: array = field(default_factory=lambda: array("f"))  # float32
    dim: int = 0
    num_tokens: array = field(default_factory=lambda: array("i"))  # int32, per input
    error: str | None = None
    error_status: int = 0
    error_param: str | None = None
