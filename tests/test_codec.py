"""The wire codec (pipellm/shared/codec.py): registered dataclasses round-trip, nested and with
token arrays; fields equal to their defaults stay off the wire; anything else is refused."""

from array import array

import msgpack
import pytest

from pipellm.shared import codec
from pipellm.shared.messages import Delta, DeltaBatch, GenerateRequest, Route, Tokens
from pipellm.shared.sampling import SamplingParams


def tokens(n: int, k: int = 0) -> Tokens:
    return Tokens("r:0", 7, array("i", range(n)), array("f", [-0.5] * n),
                  array("i", range(n * k)), array("f", [-1.0] * (n * k)), "stop" if n else None)


@pytest.mark.parametrize("msg", [
    Delta("r:0"),  # every field at its default
    Delta("r:0", " word", tokens(1), num_prompt=200, num_output=1),
    Delta("r:0", tokens=tokens(3, 2), finish_reason="length", error="boom", error_status=503,
          started_at=12.5, prompt_ids=array("i", [1, 2]), prompt=tokens(2), reasoning="hm"),
    DeltaBatch([Delta("a:0", "x"), Delta("b:1", tokens=tokens(0))]),
    GenerateRequest("r:0", array("i", [5, 6, 7]), SamplingParams(temperature=0.7, top_p=0.9,
                                                                 max_tokens=9),
                    Route("r:0", "ipc://gw", 3, array("i", [6, 7]), ["\n"]),
                    predicted_length=[3, 4], output_ids=array("i", [8]), priority=-1),
])
def test_messages_round_trip(msg):
    back = codec.decode(codec.encode(msg))
    assert back == msg and type(back) is type(msg)


def test_fields_at_their_defaults_stay_off_the_wire():
    """A one-token delta sends what differs from the defaults (the decoder's constructor fills
    in the rest): half the bytes of sending every field."""
    one = Tokens("r:0", 7, array("i", [5]), array("f", [-0.5]))
    delta = Delta("r:0", " word", one, num_prompt=200, num_output=1)
    sent = msgpack.unpackb(codec.encode(delta), raw=False)
    assert set(sent) == {"_t", "request_id", "text", "tokens", "num_prompt", "num_output"}
    assert set(sent["tokens"]) == {"_t", "request_id", "start", "token_ids", "logprobs"}
    every = {"_t": "Delta", **{f: getattr(delta, f) for f in delta.__dataclass_fields__}}
    assert len(codec.encode(delta)) < 0.6 * len(msgpack.packb(every, default=codec._default))
    zero = Delta("r:0", num_output=0, error=None)  # equal to the defaults: left out too
    assert set(msgpack.unpackb(codec.encode(zero), raw=False)) == {"_t", "request_id"}


def test_what_is_not_a_registered_message_is_refused():
    with pytest.raises(TypeError, match="not a registered message"):
        codec.encode(object())
    with pytest.raises(TypeError, match="typecode 'd'"):
        codec.encode(Delta("r:0", prompt_ids=array("d", [1.0])))
    for data in (msgpack.packb({"_t": "Nope"}), msgpack.packb(msgpack.ExtType(9, b"1234")),
                 msgpack.packb(msgpack.ExtType(1, b"123")), msgpack.packb({"_t": "Delta"}),
                 b"\xc1"):
        with pytest.raises(codec.DecodeError):
            codec.decode(data)
