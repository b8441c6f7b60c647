"""The tokenizers' data-parallel routing (pipellm/services/tokenizer/dispatch.py) over a real Redis:
two tokenizers routing one burst see each other's requests (the shared `pending` demand), a
compute's publication settles what it received in the same transaction, a restart's reset
clamps late settlements at 0, and a compute without a heartbeat gets nothing. The computes'
inboxes are recording senders: this tests the routing decision, the served path is
tests/test_data_parallel.py."""

from __future__ import annotations

from array import array

import pytest
import redis

from pipellm.services.tokenizer.dispatch import Dispatcher
from pipellm.shared import state
from pipellm.shared.messages import GenerateRequest, Route
from pipellm.shared.redis_server import EmbeddedRedis
from pipellm.shared.routing import make_policy
from pipellm.shared.sampling import SamplingParams

SERVER = "test-dp"


class Inbox:
    """A compute's inbox: what was sent to it."""

    def __init__(self):
        self.got: list[GenerateRequest] = []

    def send(self, msg) -> None:
        self.got.append(msg)


@pytest.fixture(scope="module")
def client():
    with EmbeddedRedis() as r:
        yield redis.Redis.from_url(r.url)


@pytest.fixture
def inboxes(client):
    client.flushall()
    for rank in (0, 1):
        state.heartbeat(client, SERVER, "compute", f"{rank}.1", ttl_s=60)
    return [Inbox(), Inbox()]


def tokenizer(client, inboxes) -> Dispatcher:
    return Dispatcher(inboxes, make_policy("predicted-load"), client, SERVER, default_len=1000)


def request(i: int, max_tokens: int) -> GenerateRequest:
    rid = f"r{i}:0"
    return GenerateRequest(rid, array("i", [1, 2, 3, 4]), SamplingParams(max_tokens=max_tokens),
                           Route(rid, "gw", 4, array("i")))


def tokens(inbox: Inbox) -> int:
    return sum(g.params.max_tokens for g in inbox.got)


def test_two_tokenizers_spread_one_burst(client, inboxes):
    """A burst before any compute publishes, through two tokenizers in turn: a long request to
    each, then a short one to each, twice. Seeing only its own requests, each tokenizer would put
    its long ones on the same compute (384 against 16 tokens); with the shared pending demand the
    second long one goes to the other compute."""
    a, b = tokenizer(client, inboxes), tokenizer(client, inboxes)
    for i in range(8):
        (a if i % 2 == 0 else b).send([request(i, 96 if i % 4 < 2 else 4)])
    assert [tokens(x) for x in inboxes] == [200, 200]
    pending = [int(client.hget(state.stats_key(SERVER, r), "pending")) for r in (0, 1)]
    assert pending == [sum(g.routed_tokens for g in x.got) for x in inboxes] == [216, 216]
    prompts = client.hmget(state.stats_key(SERVER, 0), "pending_prompt"), \
        client.hmget(state.stats_key(SERVER, 1), "pending_prompt")
    assert prompts == ([b"16"], [b"16"])  # 4 requests of 4 prompt tokens each


def test_a_write_between_read_and_add_routes_again(client, inboxes):
    """Another tokenizer routes while this one chooses (its WATCH fails): this one reads the
    loads again and chooses by them."""
    a, b = tokenizer(client, inboxes), tokenizer(client, inboxes)
    choose, calls = a.policy.choose, []

    def racing(info, loads):
        calls.append([x.demand for x in loads])
        if len(calls) == 1:
            b.send([request(9, 96)])  # lands on compute 0 after `a` read the loads
        return choose(info, loads)

    a.policy.choose = racing
    a.send([request(0, 96)])
    assert calls == [[0, 0], [100, 0]]
    assert [len(x.got) for x in inboxes] == [1, 1]


def test_publication_settles_what_compute_received(client, inboxes):
    a = tokenizer(client, inboxes)
    a.send([request(0, 96)])
    routed = inboxes[0].got[0].routed_tokens
    assert routed == 100  # prompt + max_tokens (which caps the default predicted length)
    pipe = client.pipeline(transaction=True)
    state.set_stats(pipe, SERVER, 0, {"demand": routed, "running": 1, "waiting": 0}, ttl_s=60)
    state.settle_pending(pipe, SERVER, 0, routed, 4)
    pipe.execute()
    assert client.hmget(state.stats_key(SERVER, 0), "demand", "pending") == [b"100", b"0"]
    a.send([request(1, 96)])
    assert len(inboxes[1].got) == 1  # compute 0 still holds 100 published tokens


def test_restart_reset_clamps_late_settlements(client, inboxes):
    state.add_pending(client, SERVER, 0, 300, 40)  # routed to a compute that then died
    state.reset_pending(client, SERVER, 0)
    pipe = client.pipeline(transaction=True)
    state.settle_pending(pipe, SERVER, 0, 120, 20)  # a request sent before the restart
    pipe.execute()
    assert client.hmget(state.stats_key(SERVER, 0), "pending", "pending_prompt") == [b"0", b"0"]


def test_a_compute_without_heartbeat_gets_nothing(client, inboxes):
    client.delete(*client.keys(f"{state.PREFIX}svc:{SERVER}:compute:0*"))
    a = tokenizer(client, inboxes)
    for i in range(4):
        a.send([request(i, 8)])
    assert [len(x.got) for x in inboxes] == [0, 4]


def test_a_requests_priority_travels_to_the_rank_that_serves_it(client, inboxes):
    """Routed to either compute (its routed tokens set on the way), each choice keeps its
    priority, through the codec the inbox's socket would carry it with."""
    from dataclasses import replace

    from pipellm.shared.codec import decode, encode

    a = tokenizer(client, inboxes)
    for i, p in enumerate((7, -3, 0, 2)):
        a.send([replace(request(i, 96 if i % 2 else 4), priority=p)])
    got = {g.request_id: decode(encode(g)) for inbox in inboxes for g in inbox.got}
    assert all(inbox.got and all(g.routed_tokens > 0 for g in inbox.got) for inbox in inboxes)
    assert {rid: g.priority for rid, g in got.items()} == {"r0:0": 7, "r1:0": -3, "r2:0": 0,
                                                           "r3:0": 2}
