"""vLLM's beam search fields on both endpoints: `use_beam_search` (the beam width is best_of
if given, else n; the n best hypotheses are the choices), `length_penalty`, `early_stopping`
(true, false or "never", as transformers'). Beam search scores the model's own
log-probabilities: temperature, top_k/top_p/min_p, penalties and logit_bias do not apply
(as in vLLM); what it cannot do is a 400."""

from __future__ import annotations

from typing import Any

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.validation import get_bool, get_number

KEYS = frozenset({"use_beam_search", "length_penalty", "early_stopping"})


def parse_beam(body: dict, n: int, best_of: int) -> dict[str, Any]:
    """SamplingParams' beam search fields of `body` ({} without use_beam_search)."""
    if not get_bool(body, "use_beam_search", False):
        return {}
    if get_bool(body, "stream", False):
        raise bad_request("use_beam_search cannot be streamed: the beams are ranked when the "
                          "search ends; send stream: false", "stream")
    early = body.get("early_stopping", False)
    if early not in (True, False, "never"):
        raise bad_request('early_stopping must be true, false or "never"', "early_stopping")
    return dict(beam_width=max(best_of, n), beam_n=n, early_stopping=early,
                length_penalty=get_number(body, "length_penalty", 1.0))


def check_beam(top_logprobs: int, echo: bool, constrained: bool) -> None:
    """400s for what a beam search request cannot ask for as well."""
    if top_logprobs:
        raise bad_request("use_beam_search returns each token's logprob, not the most likely "
                          "alternatives: ask for logprobs 0", "logprobs")
    if echo:
        raise bad_request("use_beam_search cannot echo the prompt", "echo")
    if constrained:
        raise bad_request("use_beam_search cannot follow response_format or tool_choice",
                          "use_beam_search")
