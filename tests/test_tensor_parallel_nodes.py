"""Data-parallel replicas of tensor-parallel groups across machines (`--nnodes` with
`--data-parallel-size`): where each replica's ranks meet (`replica_master_port`, which node 0's
supervisor and another node's tp_node both take), each rank's share of its machine's cores, and
the ports past 65535 that `pipellm serve` refuses in one line, on every node, before anything
starts. Served on two machines (both on this one): tests/test_tensor_parallel_e2e.py."""

from __future__ import annotations

import os

import pytest

from pipellm.services.cli import main
from pipellm.services.compute.tp_node import replica_config
from pipellm.services.supervisor import compute_env
from pipellm.shared.config import EngineConfig, check_replicas, replica_master_port
from tests.hf_models import build_hf_model


def nodes(**kw) -> EngineConfig:
    """--tensor-parallel-size 4 over two machines, meeting at 10.0.0.1:29500."""
    return EngineConfig(**{"model": "unused", "tensor_parallel_size": 4, "nnodes": 2,
                           "master_addr": "10.0.0.1", "master_port": 29500} | kw)


def test_node_0_and_node_1_agree_where_each_replica_meets(monkeypatch):
    """Replica d meets on --master-port + d: node 0's compute d is told so, node 1's ranks of
    replica d wait there; on 16 cores, 3 replicas of 2 ranks a machine: 2 threads a rank."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    node0 = [compute_env(nodes(), 3, d) for d in range(3)]
    node1 = [replica_config(nodes(node_rank=1), d, 3) for d in range(3)]
    assert [int(env["PIPELLM_MASTER_PORT"]) for env in node0] == [29500, 29501, 29502]
    assert [c.master_port for c in node1] == [29500, 29501, 29502]
    assert {env["PIPELLM_THREADS"] for env in node0} == {"2"}
    assert {c.threads for c in node1} == {2}
    assert replica_config(nodes(node_rank=1), 0, 1) == nodes(node_rank=1)  # one: as given
    assert replica_config(nodes(node_rank=1, threads=3), 1, 3).threads == 3


def test_replicas_on_one_machine_each_take_a_free_port():
    """Without --master-port (one machine) each replica's store takes a free port."""
    one = EngineConfig(model="unused", tensor_parallel_size=2)
    assert replica_master_port(one, 1) == 0
    assert "PIPELLM_MASTER_PORT" not in compute_env(one, 2, 1)


def test_replicas_meeting_past_port_65535_are_refused(tmp_path, capsys):
    check_replicas(nodes(master_port=65534), 2)  # 65534 and 65535
    check_replicas(nodes(master_port=65535), 1)
    with pytest.raises(ValueError, match="65536 is past 65535") as e:
        check_replicas(nodes(master_port=65535), 2)
    assert "\n" not in str(e.value)
    build_hf_model(tmp_path, "llama")
    capsys.readouterr()  # its progress bar
    for node in ("0", "1"):
        assert main(["serve", str(tmp_path), "--tensor-parallel-size", "2", "--nnodes", "2",
                     "--node-rank", node, "--master-port", "65535",
                     "--data-parallel-size", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pipellm: error: --master-port 65535 with --data-parallel-size 2:")
        assert err.count("\n") == 1
