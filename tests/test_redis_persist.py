"""`pipellm up --redis-dir`: the embedded Redis keeps the learned length model across restarts."""

from __future__ import annotations

import redis

from pipellm.shared.length_predictor import LengthPredictor, length_features
from pipellm.shared.redis_server import EmbeddedRedis


def test_learned_lengths_survive_a_redis_restart(tmp_path):
    feats = length_features("translate this sentence", [1, 2, 3], 256, "m")
    with EmbeddedRedis(data_dir=str(tmp_path), persist=True) as r:
        p = LengthPredictor(redis.Redis.from_url(r.url), "m", strict=True)
        for n in (5, 6, 7, 5, 6) * 4:
            p.update(feats, n)
        before = p.predict(feats, 256)
    with EmbeddedRedis(data_dir=str(tmp_path), persist=True) as r:  # a new server, same dir
        p = LengthPredictor(redis.Redis.from_url(r.url), "m", strict=True)
        assert sum(p.counts()) == 20 and p.predict(feats, 256) == before
    (tmp_path / "fresh").mkdir()
    with EmbeddedRedis(data_dir=str(tmp_path / "fresh")) as r:
        assert sum(LengthPredictor(redis.Redis.from_url(r.url), "m").counts()) == 0


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """Ports the stacks and the embedded Redis take: free, and outside the range outgoing
    connections draw from (a port picked there can be taken before its server binds it);
    random.seed in a process does not make two processes pick alike."""
    import random
    import socket

    from pipellm.shared.redis_server import _EPHEMERAL, free_port

    low = int(_EPHEMERAL.read_text().split()[0]) if _EPHEMERAL.is_file() else 32768
    random.seed(0)
    ports = {free_port() for _ in range(20)}
    random.seed(0)
    assert ports != {free_port() for _ in range(20)}  # not the seeded module state
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
