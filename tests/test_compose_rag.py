"""compose.rag.yaml, checked statically (tests/test_router_models.py runs the same set-up as
processes): the generation server's and the pooling server's `pipellm serve` commands parse
with the real CLI parser in their containers' environment; one runs the generation runner, the
other really selects the pooling runner; both use the shared Redis and the model baked into
the image, listen on all interfaces, and have server ids and host names of their own and
served names of their own; the router runs in its multi-model mode (`--enable-igw`, where it
routes by the `model` field) and the registrar (pipellm/services/router_workers.py, parsed with its
own parser) names exactly the two servers' URLs, each with the name that server serves. A
broken copy shows the checks can fail."""

from __future__ import annotations

import copy

import pytest

from pipellm.services import router_workers
from tests.test_compose import ROOT
from tests.test_compose_scale import parse_serve

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse compose files")

REDIS = "redis://redis:6379/0"
MODEL = "/opt/pipellm/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def load() -> dict:
    return yaml.safe_load((ROOT / "compose.rag.yaml").read_text(encoding="utf-8"))


def registrar_workers(service: dict) -> tuple[str, list[router_workers.Worker]]:
    """The registrar's router URL and workers, through its own argument parser."""
    command = service["command"]
    assert command[:3] == ["python", "-m", "pipellm.services.router_workers"], command[:3]
    captured = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(router_workers, "run", lambda router, workers, *a: captured.append(
            (router, workers)) or 0)
        assert router_workers.main(command[3:]) == 0
    return captured[0]


def check(compose: dict) -> None:
    services = compose["services"]
    served: dict[str, str] = {}  # URL -> served model name
    ids, kinds = set(), {}
    for name in ("generate", "embed"):
        engine, svc = parse_serve(name, services[name])
        assert svc.redis_url == REDIS, f"{name}: not on the shared Redis"
        assert svc.host == "0.0.0.0" and svc.port == 8000, f"{name}: not reachable"
        assert engine.model == MODEL, f"{name}: not the image's model"
        assert services[name].get("hostname") == name, f"{name}: its host name"
        assert svc.server_id, f"{name}: no --server-id"
        ids.add(svc.server_id)
        assert svc.served_model_name, f"{name}: no --served-model-name"
        served[f"http://{name}:8000"] = svc.served_model_name
        kinds[name] = engine.pooling
    assert len(ids) == 2, f"the servers share a server id: {ids}"
    assert len(set(served.values())) == 2, f"the servers share a model name: {served}"
    assert kinds == {"generate": False, "embed": True}, kinds  # the runners they select
    router = services["router"]["command"]
    assert router[0] == "vllm-router" and "--enable-igw" in router, router
    assert "--worker-urls" not in router  # ignored with --enable-igw: the registrar's job
    assert "8000:8000" in services["router"]["ports"]
    url, workers = registrar_workers(services["router-workers"])
    assert url == "http://router:8000", url
    assert {w.url: w.model for w in workers} == served, (workers, served)
    assert services["redis"]["image"] == "redis:7"


def test_compose_rag_is_wired():
    check(load())


@pytest.mark.parametrize("breakage", ["generation runner", "own redis", "same server id",
                                      "wrong model name", "no igw", "missing worker"])
def test_the_checks_catch_a_broken_copy(breakage):
    compose = copy.deepcopy(load())
    services = compose["services"]
    embed, registrar = services["embed"]["command"], services["router-workers"]["command"]
    if breakage == "generation runner":  # the embedder as a generation server
        for flag in ("--runner", "--convert"):
            i = embed.index(flag)
            del embed[i:i + 2]
    elif breakage == "own redis":
        i = embed.index("--redis-url")
        del embed[i:i + 2]
    elif breakage == "same server id":
        embed[embed.index("--server-id") + 1] = "generate"
    elif breakage == "wrong model name":
        registrar[registrar.index("http://embed:8000=smollm2-embed")] = "http://embed:8000=x"
    elif breakage == "no igw":
        services["router"]["command"].remove("--enable-igw")
    else:
        i = registrar.index("http://generate:8000=smollm2")
        del registrar[i - 1:i + 1]
    with pytest.raises(AssertionError):
        check(compose)


@pytest.mark.parametrize("spec", ["http://embed:8000", "http://embed:8000=", "embed=smollm2"])
def test_the_registrar_refuses_a_worker_without_url_or_model(spec, capsys):
    with pytest.raises(SystemExit) as e:
        router_workers.main(["--router", "http://router:8000", "--worker", spec])
    assert e.value.code == 2 and "expected URL=MODEL" in capsys.readouterr().err
