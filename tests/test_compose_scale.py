"""compose.scale.yaml, checked statically (tests/test_docker_scale.py runs it): every replica's
`pipellm serve` command parses with the real CLI parser in its container's environment, uses
the shared Redis and the model baked into the image, listens on all interfaces, and has a host
name of its own (its --server-id in the shared Redis); the router (vllm-router, cache-aware,
quick health checks) lists exactly the replicas' URLs and publishes its port; the router image
pins the version the tests check. A broken copy shows the checks can fail."""

from __future__ import annotations

import copy
import os
import re

import pytest

from pipellm.services import cli
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.settings import config_from_args
from tests.test_compose import ROOT, environment

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse compose files")


def load() -> dict:
    return yaml.safe_load((ROOT / "compose.scale.yaml").read_text(encoding="utf-8"))


def parse_serve(name: str, service: dict) -> tuple[EngineConfig, ServiceConfig]:
    """`pipellm serve ...` through pipellm.services.cli.main in the container's environment, the
    supervisor stubbed out: the real parser, nothing started."""
    command = service["command"]
    assert command[:2] == ["pipellm", "serve"], f"{name}: runs {command[:2]}"
    captured = []
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("PIPELLM_") or k == "REDIS_URL"]:
            mp.delenv(key)
        for key, value in environment(service).items():
            mp.setenv(key, value)
        mp.setattr("pipellm.services.supervisor.up",
                   lambda engine, svc: captured.append((engine, svc)) or 0)
        mp.setattr(cli, "_check_model", lambda engine: None)  # the model is in the image
        mp.setattr(cli, "_configs", lambda args: (
            config_from_args(EngineConfig, args, model=args.model),
            config_from_args(ServiceConfig, args)))
        rc = cli.main(command[1:])
    assert rc == 0 and len(captured) == 1, f"{name}: {command} does not parse"
    return captured[0]


def replicas(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if n.startswith("replica-")}


def check(compose: dict) -> None:
    reps = replicas(compose)
    assert len(reps) >= 2, "fewer than two replicas"
    hosts = set()
    for name, service in reps.items():
        engine, svc = parse_serve(name, service)
        assert svc.redis_url == "redis://redis:6379/0", f"{name}: not on the shared Redis"
        assert svc.host == "0.0.0.0" and svc.port == 8000, f"{name}: not reachable"
        assert engine.model == "/opt/pipellm/models/SmolLM2-135M-Instruct.Q4_1.gguf", name
        assert service.get("hostname") == name, f"{name}: its host name is its server id"
        hosts.add(name)
    router = compose["services"]["router"]["command"]
    urls = router[router.index("--worker-urls") + 1:]
    urls = urls[:next((i for i, a in enumerate(urls) if a.startswith("--")), len(urls))]
    assert sorted(urls) == sorted(f"http://{h}:8000" for h in hosts), urls
    assert router[router.index("--policy") + 1] == "cache_aware"
    assert router[router.index("--health-check-interval-secs") + 1] == "1"
    assert "8000:8000" in compose["services"]["router"]["ports"]
    assert compose["services"]["redis"]["image"] == "redis:7"


def test_compose_scale_is_wired():
    check(load())


def test_the_router_image_pins_the_tested_version():
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    setup = (ROOT / "scripts/setup.sh").read_text(encoding="utf-8")
    pinned = re.findall(r"vllm-router==([\d.]+)", dockerfile)
    assert pinned and pinned == re.findall(r"vllm-router==([\d.]+)", setup)


@pytest.mark.parametrize("breakage", ["missing url", "own redis", "same host"])
def test_the_checks_catch_a_broken_copy(breakage):
    compose = copy.deepcopy(load())
    if breakage == "missing url":
        cmd = compose["services"]["router"]["command"]
        cmd.remove("http://replica-2:8000")
    elif breakage == "own redis":
        compose["services"]["replica-1"]["command"] = ["pipellm", "serve", "--host", "0.0.0.0",
                                                       "--port", "8000"]
    else:
        compose["services"]["replica-2"]["hostname"] = "replica-1"
    with pytest.raises(AssertionError):
        check(compose)
