"""The fields `/v1/completions` and `/v1/chat/completions` know, declared once.

- COMPLETION_KEYS, CHAT_KEYS: every key each endpoint reads (protocol.py parses them); any
  other key is ignored and logged, or with --strict-request-fields a 400, as vLLM does.
- COMPLETION_NEUTRAL, CHAT_NEUTRAL: known fields pipellm does not implement, with the values
  that ask for nothing (null always does): any other value is a 400 "`X` is not supported"
  (validation.reject_unsupported) rather than an answer that silently ignores it.
"""

from __future__ import annotations

from pipellm.services.gateway import structured, tools
from pipellm.services.gateway.beam import KEYS as BEAM_KEYS

_COMMON_KEYS = frozenset({
    "model", "frequency_penalty", "presence_penalty", "logprobs", "max_tokens", "n", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "user",
    # vLLM extensions we implement
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "logit_bias", *BEAM_KEYS,
    "request_id", "priority",  # priority: a 400 unless --scheduling-policy reorders (app.py)
    "truncate_prompt_tokens", "truncation_side", "include_stop_str_in_output",
    "no_stop_trim", "skip_special_tokens", "return_token_ids", "return_tokens_as_token_ids",
    "allowed_token_ids", "bad_words", "cache_salt", "prompt_logprobs", "add_special_tokens",
    "stream_interval",  # vLLM's tokens a streamed chunk: a pacing hint; chunks stay per token
})
# SGLang/vLLM extras that the routers in front of replicas (vllm-router, sglang-router) add to
# every body they forward, with the values they add: none asks for anything here (no hidden
# states; spaces_between_special_tokens is a slow tokenizer's option, and fast ones, which all of
# ours are, join special tokens as they are either way, as vLLM's fast detokenizer does).
_ROUTER_NEUTRAL: dict[str, tuple] = {
    "return_hidden_states": (False,),
    "spaces_between_special_tokens": (True, False),
}
# vLLM 0.32's fields for features pipellm does not have (disaggregated KV transfer, plugins'
# extra args, watermarks, repetition detection, logprobs of chosen ids, token offsets, routed
# experts, multimodal inputs and sessions)
_VLLM_NEUTRAL: dict[str, tuple] = {
    "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": ({},),
    "watermarking": (), "repetition_detection": (), "logprob_token_ids": ([],),
    "return_token_offsets": (False,), "routed_experts_prompt_start": (), "mm_payload": (),
    "return_mm_kwargs": (False,), "session_id": (),
}
# OpenAI's strings that label a chat request and ask for nothing beyond it (as `user`): a cache
# routing hint (the prefix cache needs none) and an abuse-monitoring id; checked to be strings
LABELS = ("prompt_cache_key", "safety_identifier")
COMPLETION_NEUTRAL: dict[str, tuple] = {"suffix": ("",), "prompt_embeds": (),
                                        **_ROUTER_NEUTRAL, **_VLLM_NEUTRAL}
CHAT_NEUTRAL: dict[str, tuple] = {
    # OpenAI's
    "functions": ([],), "function_call": ("none",),
    "metadata": ({},), "store": (False,), "service_tier": ("auto", "default"),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "verbosity": (), "moderation": (),
    "prompt_cache_options": (), "prompt_cache_retention": (),
    # vLLM's and SGLang's
    "return_prompt_text": (False,), "mm_processor_kwargs": ({},), "media_io_kwargs": ({},),
    "stream_reasoning": (True, False), **_ROUTER_NEUTRAL, **_VLLM_NEUTRAL,
}
COMPLETION_KEYS = frozenset(_COMMON_KEYS | {"prompt", "best_of", "echo"} | structured.KEYS
                            | COMPLETION_NEUTRAL.keys())
CHAT_KEYS = frozenset(_COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs",
                                      "add_generation_prompt", "continue_final_message",
                                      "chat_template_kwargs", "chat_template", "documents",
                                      "echo", "include_reasoning", "separate_reasoning",
                                      "thinking_token_budget", *LABELS}
                      | structured.KEYS | tools.KEYS | CHAT_NEUTRAL.keys())
