"""`pipellm serve --tensor-parallel-size 2` (pipellm/services/compute/tp/) through the real services
and the official client: the compute process is rank 0 and starts rank 1; either killed, compute
restarts with a new group and the streams resume; data parallel computes of tensor-parallel
groups; a mixture of experts' whole experts a rank (`--enable-expert-parallel`); ranks on two
machines (`--nnodes 2`, here both on this one), alone and as data-parallel replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import psutil
import pytest

from pipellm.services.compute.tp import group
from pipellm.shared.redis_server import free_port
from pipellm.shared.sampling import SamplingParams
from tests.hf_models import build_hf_model
from tests.stack import Stack
from tests.test_data_parallel import per_engine, routes
from tests.test_faults import MODEL, run_round
from tests.test_tensor_parallel import PROMPTS, assert_same, engine, generate


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    """One server on 2 ranks, one thread each; small steps, so that a kill lands mid-stream."""
    s = Stack(demo_model_dir, "--max-batched-tokens", "32", "--max-running", "32",
              "--tensor-parallel-size", "2", "--threads", "1", "--dtype", "float32",
              embedded_redis=True).start(timeout_s=180)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def uninterrupted(stack):
    """test_faults' round of streaming and whole requests, on the running server."""
    results, _ = asyncio.run(run_round(stack))
    assert all(r["error"] is None and r["finish"] == "length" for r in results), results
    return results


def test_served_to_the_official_client(stack, demo_model_dir):
    """The compute process is rank 0: completions (a batch of token-id prompts, and streamed)
    carry the tokens and logprobs of one rank run offline; the banner counts the ranks."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    expected = generate(engine(demo_model_dir, 1), PROMPTS, params)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=10, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    answer = client.completions.create(prompt=PROMPTS, **kw)
    streamed = [c.choices[0] for c in client.completions.create(prompt=PROMPTS[3], stream=True,
                                                                  **kw)]
    choices = sorted(answer.choices, key=lambda c: c.index)
    served = [(c.token_ids, c.logprobs.token_logprobs, []) for c in choices]
    assert_same(expected, served)
    assert [t for c in streamed for t in c.token_ids] == expected[3][0]
    assert "on cpu x 2 tensor-parallel ranks" in stack.wait_for_log("pipellm is up")


def rank1_pid(stack: Stack) -> int:
    """The pid of compute's rank 1."""
    return rank1_pid_of(stack.pid("compute"))


def rank1_pid_of(compute: int) -> int:
    """The pid of rank 1 of compute process `compute` (its child running the tp worker)."""
    (proc,) = [p for p in psutil.Process(compute).children()
               if "pipellm.services.compute.tp_worker" in p.cmdline()]
    return proc.pid


def alive(pid: int, wait_s: float = 10) -> bool:
    """Whether process `pid` still runs (not a zombie) after up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("victim", ["compute", "rank 1"])
def test_a_killed_rank_restarts_the_group_and_streams_resume(stack, uninterrupted, victim):
    """kill -9 of rank 0 (the compute process; rank 1 then fails its next collective, or dies
    with it) or of rank 1 (rank 0's next collective fails, compute exits): the supervisor
    restarts compute, which starts a new rank 1, and the gateway resumes every stream with
    the uninterrupted run's text."""
    old, old_rank1 = stack.pid("compute"), rank1_pid(stack)
    pid = old if victim == "compute" else old_rank1
    results, _ = asyncio.run(run_round(stack, lambda: os.kill(pid, signal.SIGKILL)))
    for r, w in zip(results, uninterrupted, strict=True):
        assert (r["error"], r["text"], r["finish"]) == (None, w["text"], "length")
    assert stack.pid("compute") != old and rank1_pid(stack) != old_rank1
    assert not alive(old_rank1)  # no rank outlives its group


def test_data_parallel_computes_are_each_a_tensor_parallel_group(demo_model_dir):
    """--data-parallel-size 2 x --tensor-parallel-size 2: two compute processes, each rank 0
    of its own group with its own rank 1; requests routed to either get one rank's tokens."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [ids for ids, _, _ in generate(engine(demo_model_dir, 1), PROMPTS, params)]
    stack = Stack(demo_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                  "--dtype", "float32", "--data-parallel-routing", "round-robin"
                  ).start(timeout_s=180)
    try:
        computes = [stack.pid(f"compute-{r}") for r in range(2)]
        assert len({rank1_pid_of(pid) for pid in computes}) == 2
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        got = [client.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
            for p in PROMPTS]
    finally:
        stack.stop()
    assert got == expected



def test_expert_parallel_served_to_the_official_client(tmp_path):
    """--enable-expert-parallel served: a tiny Mixtral, experts 0..3 on rank 0 and 4..7 on
    rank 1, gives one rank's tokens and logprobs through the services; the banner says so."""
    path = tmp_path / "mixtral"
    build_hf_model(path, "mixtral", with_tokenizer=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    expected = generate(engine(path, 1), PROMPTS, params)
    stack = Stack(path, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--threads",
                  "1", "--dtype", "float32", "--quantization", "none").start(timeout_s=180)
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(
            model="mixtral", prompt=PROMPTS, max_tokens=8, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        banner = stack.wait_for_log("pipellm is up")
    finally:
        stack.stop()
    choices = sorted(answer.choices, key=lambda c: c.index)
    assert_same(expected, [(c.token_ids, c.logprobs.token_logprobs, []) for c in choices])
    assert "on cpu x 2 tensor-parallel ranks, expert-parallel: 4 experts a rank" in banner


def test_ranks_across_two_machines_follow_rank_0_from_group_to_group(tmp_path, monkeypatch):
    """--nnodes 2 on one machine: node 1 (`pipellm serve --node-rank 1`, its own settings)
    runs rank 1 only; two engines in turn on node 0 (rank 0) each meet a rank 1 of node 1's at
    --master-port and give one rank's tokens."""
    monkeypatch.setattr(group, "START_TIMEOUT_S", 30.0)  # a rank 1 missing fails in 30 s
    path, port = tmp_path, free_port()
    build_hf_model(path, "llama")
    meet = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "pipellm.services.cli", "serve", str(path),
                              *meet, "--node-rank", "1", "--dtype", "float32", "--threads", "1",
                              "--quantization", "none", "--kv-cache-tokens", "2048",
                              "--max-batched-tokens", "16", "--max-running", "8"])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    try:
        one = generate(engine(path, 1), PROMPTS, params)
        for _ in range(2):
            eng = engine(path, 2, nnodes=2, master_addr="127.0.0.1", master_port=port)
            try:
                assert eng.runner.ranks.procs == []  # rank 1 is node 1's
                assert_same(one, generate(eng, PROMPTS, params))
            finally:
                eng.runner.close()
    finally:
        node1.terminate()
        node1.wait()



def meeting_ports(n: int) -> int:
    """A port P with P .. P + n - 1 free on this machine."""
    while True:
        port = free_port()
        try:
            for p in range(port + 1, port + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def node_ranks(node: subprocess.Popen) -> set[int]:
    """The pids of the tensor-parallel ranks a node K > 0 runs (its tp_worker children)."""
    return {p.pid for p in psutil.Process(node.pid).children()
            if "pipellm.services.compute.tp_worker" in p.cmdline() and p.status() != "zombie"}


def served(stack: Stack, expected: list) -> set[int]:
    """PROMPTS through the official client, each output checked against `expected`: the
    computes (data-parallel ranks) that served them."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    ranks = set()
    for prompt, want in zip(PROMPTS, expected, strict=True):
        answer = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert answer.choices[0].token_ids == want
        ranks.add(routes(stack, answer.id).index(1))
    return ranks


def test_data_parallel_groups_across_two_machines(demo_model_dir, tmp_path):
    """--nnodes 2 x --data-parallel-size 2 x --tensor-parallel-size 2, both machines on this
    one: node 0 serves and runs each replica's rank 0, node 1 (`--node-rank 1`) each
    replica's rank 1, replica d meeting at --master-port + d; requests reach both replicas
    and get one rank's tokens. Compute 1 killed: node 1 restarts replica 1's rank only, and
    replica 1 serves again."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [ids for ids, _, _ in generate(engine(demo_model_dir, 1), PROMPTS, params)]
    common = ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(meeting_ports(2)),
              "--dtype", "float32", "--threads", "1", "--kv-cache-tokens", "20000"]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "pipellm.services.cli", "serve",
                                  str(demo_model_dir), *common, "--node-rank", "1"],
                                 stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(demo_model_dir, *common, "--node-rank", "0", "--data-parallel-routing",
                  "round-robin")
    try:
        stack.start(timeout_s=180)
        deadline = time.monotonic() + 60  # /health is green once one compute serves
        while set(per_engine(stack, "vllm:num_requests_running")) != {"0", "1"}:
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.1)
        assert served(stack, expected) == {0, 1}
        ranks = node_ranks(node1)
        assert len(ranks) == 2  # one rank 1 a replica
        compute0 = stack.pid("compute-0")
        os.kill(stack.pid("compute-1"), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while 1 not in served(stack, expected):  # until compute 1 is back, with a new group
            assert time.monotonic() < deadline, stack.logs()
        after = node_ranks(node1)
        assert len(after) == 2 and len(after & ranks) == 1  # replica 0's rank untouched
        assert stack.pid("compute-0") == compute0
    finally:
        stack.stop()
        node1.terminate()
        node1.wait()
