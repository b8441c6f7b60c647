"""A tokenizer worker: chat template + tokenization, context checks, the output-length
prediction, n-way fan-out.

Each request gets a predicted output-length distribution from the length predictor in Redis
(compute sizes its KV segment with it) and carries its features along to the detokenizer,
which teaches the predictor the true length at finish. With Redis down, or `--no-length-
predictor`, requests go without one (compute then uses --default-predicted-len).

Several workers may pull from the gateway's one PUSH socket (zmq spreads requests across them).
A request that cannot be served (template error, prompt too long, bad token ids) is answered
to its gateway with a 400 error; everything else goes to compute as GenerateRequests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from array import array

import redis
import zmq

from pipellm.services.tokenizer.dispatch import Dispatcher
from pipellm.services.tokenizer.embed import EmbedInputError, prepare_embed
from pipellm.shared import state
from pipellm.shared.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    request_template,
    template_message,
)
from pipellm.shared.choice import ChoiceId
from pipellm.shared.codec import int32s
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.grammar import GrammarSpec
from pipellm.shared.heap import settle_heap
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.length_predictor import LengthPredictor, length_features, model_key
from pipellm.shared.lora import adapter_scope
from pipellm.shared.messages import (
    Delta,
    DeltaBatch,
    EmbedRequest,
    EmbedResult,
    GenerateRequest,
    Resume,
    Route,
    TokenizeRequest,
)
from pipellm.shared.model_config import ModelConfig, served_context
from pipellm.shared.reasoning import parser
from pipellm.shared.routing import make_policy
from pipellm.shared.sampling import InvalidParams, SamplingParams
from pipellm.shared.tokenizer import encode, load_tokenizer
from pipellm.shared.tool_prompt import render_chat, tool_dicts
from pipellm.shared.transport import Receiver, Sender, Senders

log = logging.getLogger("pipellm.tokenizer")
_PROMPT_TAIL = 10  # prompt tokens the detokenizer gets as decoding context (>= 9: whole chars)


class PromptError(ValueError):
    """A request this tokenizer cannot serve (a 400); `param` names the field, if one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Tokenizer:
    """Pure request preparation (no sockets): TokenizeRequest -> GenerateRequests."""

    def __init__(self, config: EngineConfig, predictor: LengthPredictor | None = None):
        self.max_model_len = served_context(config)
        self.vocab_size = ModelConfig.from_path(config.model).vocab_size
        self.tok = load_tokenizer(config.model)
        self.template = load_chat_template(config.model, config.chat_template)
        self.model_path = config.model
        self.model = model_key(config.model)
        self.predictor = predictor

    def prompt(self, req: TokenizeRequest) -> tuple[str, list[int]]:
        """(prompt text, or "" when given as ids; prompt token ids), truncated as asked."""
        text, ids = self._prompt(req)
        k = self.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        if 0 < k < len(ids):
            ids = ids[-k:] if req.truncation_side == "left" else ids[:k]
        return text, ids

    def _prompt(self, req: TokenizeRequest) -> tuple[str, list[int]]:
        if req.messages is not None:
            template = self._template(req)
            messages = [template_message(m) for m in req.messages]
            extra = json.loads(req.chat_template_kwargs) if req.chat_template_kwargs else None
            text = render_chat(template, messages, req.add_generation_prompt,
                               tool_dicts(req.tools), extra, req.continue_final_message)
            return text, encode(self.tok, text, add_special_tokens=bool(req.add_special_tokens))
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise PromptError(f"prompt token id {bad} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", param="prompt")
            return "", ids
        return req.prompt_text or "", encode(self.tok, req.prompt_text or "",
                                             add_special_tokens=req.add_special_tokens is not False)

    def _template(self, req: TokenizeRequest) -> ChatTemplate:
        """The template a chat request renders with: its own (the gateway let it through:
        --trust-request-chat-template), else the model's."""
        if req.chat_template:
            return self._request_template(req.chat_template)
        if self.template is None:
            raise PromptError("this model has no chat template; use /v1/completions")
        return self.template

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one tokenizer a process)
    def _request_template(self, source: str) -> ChatTemplate:
        return request_template(self.model_path, source)

    def _word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as it starts a text and (where that is another token)
        after a space, as vLLM tokenizes them."""
        out = []
        for word in words:
            alone = tuple(encode(self.tok, word.lstrip(), add_special_tokens=False))
            spaced = tuple(encode(self.tok, " " + word.lstrip(), add_special_tokens=False))
            out += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone)
                              else [])
        return tuple(ids for ids in out if ids)

    def _thinking(self, params: SamplingParams, name: str, budget: int) -> SamplingParams:
        """params with the reasoning's markers as token ids: for a thinking budget (0: none),
        and for a grammar, which compute starts once the reasoning has ended."""
        rule = parser(name)
        ids = lambda text: tuple(encode(self.tok, text, add_special_tokens=False))  # noqa: E731
        return dataclasses.replace(params, thinking_budget=budget, thinking_end_ids=ids(rule.end),
                                   thinking_start_ids=() if rule.starts_in_reasoning
                                   else ids(rule.start))

    def predict(self, text: str, ids: list[int], params: SamplingParams, req: TokenizeRequest,
                ) -> tuple[list[int], list[int] | None]:
        """(length features, predicted quantiles; None without a predictor). With Redis down
        the predictor answers its default (and logs it). The features of a LoRA adapter's
        requests are its own (learned apart from the base's and other adapters'). A request
        that only max_tokens can end (ignore_eos, no stop string, stop token or grammar) is
        known to make exactly max_tokens: its prediction is that point, and it has no features
        (its length is the client's choice, not the model's: the predictor does not learn it)."""
        if params.ignore_eos and not (req.stop or params.stop_token_ids or req.grammar):
            return [], list(LengthDist.point(params.max_tokens).values)
        feats = length_features(text, ids, params.max_tokens,
                                adapter_scope(self.model, params.lora_name))
        if self.predictor is None:
            return feats, None
        return feats, list(self.predictor.predict(feats, params.max_tokens).values)

    def prepare(self, req: TokenizeRequest) -> list[GenerateRequest]:
        try:
            text, ids = self.prompt(req)
        except ChatTemplateError as e:
            raise PromptError(f"chat template failed: {e}") from None
        if not ids:
            raise PromptError("the prompt is empty after tokenization")
        try:  # a default max_tokens (max_tokens_auto) is lowered to the room, the client's not
            params = req.params.fit_context(len(ids), self.max_model_len, req.max_tokens_auto)
        except InvalidParams as e:
            raise PromptError(str(e)) from None
        if req.bad_words:
            params = dataclasses.replace(params, bad_words_ids=self._word_ids(req.bad_words))
        if req.reasoning_parser and (req.thinking_token_budget or req.grammar is not None):
            params = self._thinking(params, req.reasoning_parser, req.thinking_token_budget)
        feats, quantiles = self.predict(text, ids, params, req)
        packed = int32s(ids)
        route = Route(request_id="", reply_to=req.reply_to, num_prompt=len(ids),
                      prompt_tail=int32s(ids[-_PROMPT_TAIL:]), stop=list(req.stop),
                      n=req.n * req.num_prompts,
                      length_features=feats,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      skip_special_tokens=req.skip_special_tokens,
                      reasoning_parser=req.reasoning_parser,
                      prompt_ids=packed if params.prompt_logprobs is not None
                      or req.return_token_ids else None,
                      scores_prompt=params.prompt_logprobs is not None)
        first = req.first_choice
        resumes = req.resume or [Resume(first + j, 0, array("i"), 0) for j in range(req.n)]
        if params.beam_width:  # one search for all n choices: compute names them from first
            resumes = [Resume(first, max(r.attempt for r in resumes), array("i"), 0)]
        return [self._choice(req.request_id, r, r.index - first, packed, params, route,
                             quantiles, req.grammar, req.priority) for r in resumes]

    @staticmethod
    def _choice(api: str, r: Resume, j: int, prompt: array, params: SamplingParams,
                route: Route, quantiles: list[int] | None, grammar: GrammarSpec | None = None,
                priority: int = 0) -> GenerateRequest:
        """Choice r.index of the request, its prompt's choice j (seed + j: choices differ,
        resumes repeat, a batch's prompt samples as it would alone)."""
        rid = str(ChoiceId(api, r.index, r.attempt))
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + j)
        if r.output_ids:  # its first delta, the prompt's logprobs with it, was delivered
            params = dataclasses.replace(params, prompt_logprobs=None)
        route = dataclasses.replace(route, request_id=rid, resume=r if r.attempt else None)
        return GenerateRequest(rid, prompt, params, route, quantiles, r.output_ids, grammar,
                               priority=priority)


def serve(engine_cfg: EngineConfig, svc: ServiceConfig) -> None:
    client = redis.Redis.from_url(svc.redis_url)
    predictor = LengthPredictor(state.fast_client(svc.redis_url), model_key(engine_cfg.model),
                                default_len=engine_cfg.default_predicted_len) \
        if svc.length_predictor else None
    tokenizer = Tokenizer(engine_cfg, predictor)
    ctx = zmq.Context.instance()
    inbox = Receiver(ctx, svc.addr("tokenizer"), bind=False)
    outbox = Dispatcher([Sender(ctx, svc.addr("compute", r))
                         for r in range(svc.data_parallel_size)],
                        make_policy(svc.routing_policy(engine_cfg.scheduler.enable_prefix_caching)),
                        client, svc.server, engine_cfg.default_predicted_len)
    replies = Senders(ctx)
    settle_heap(svc.gc_young_threshold)
    state.Heartbeat(client, svc.server, "tokenizer", svc.heartbeat_s)  # ready: live from here
    while True:
        msg = inbox.recv()
        if isinstance(msg, TokenizeRequest):
            try:
                outbox.send(tokenizer.prepare(msg))
            except PromptError as e:
                err = Delta(msg.request_id, error=str(e), error_status=400, error_param=e.param)
                replies.send(msg.reply_to, DeltaBatch([err]))
            except Exception:  # a bug must cost one request, not the worker (and its queue)
                log.exception("request %s failed in the tokenizer", msg.request_id)
                err = Delta(msg.request_id, error="internal error in the tokenizer",
                            error_status=500)
                replies.send(msg.reply_to, DeltaBatch([err]))
        elif isinstance(msg, EmbedRequest):
            embed(tokenizer, msg, outbox, replies)


def embed(tokenizer: Tokenizer, msg: EmbedRequest, outbox: Dispatcher, replies: Senders) -> None:
    """An embeddings request's inputs as token ids to a compute, or its refusal to its gateway."""
    try:
        outbox.send_embed(prepare_embed(tokenizer.tok, msg, tokenizer.max_model_len,
                                        tokenizer.vocab_size, tokenizer.template))
    except EmbedInputError as e:
        replies.send(msg.reply_to, EmbedResult(msg.request_id, error=str(e), error_status=400,
                                               error_param=e.param))
    except Exception:  # a bug costs one request, not the worker
        log.exception("embeddings request %s failed in the tokenizer", msg.request_id)
        replies.send(msg.reply_to, EmbedResult(msg.request_id, error="internal error in the "
                                               "tokenizer", error_status=500))
