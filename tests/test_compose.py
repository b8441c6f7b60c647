"""compose.yaml and compose.gpu.yaml, checked statically: nothing is built, pulled or started
(tests/test_docker.py runs the stack where a Docker daemon is). Each check is a function that
raises AssertionError; the last tests feed them broken copies of compose.yaml to show that they
can fail.

Checked: the five services; each `pipellm service <name>` command line, with its container's
environment, parses with the real CLI parser (pipellm.services.cli.main, with the serve step stubbed
out); every zmq address a service connects to is one another service binds, on the same channel and
port, with who binds and who connects read from the services' code; the env var names are config
fields; gateway, tokenizer and detokenizer run the slim image (and import no torch), compute the
compute image; all four use the same engine settings and the model baked into the images;
nothing needs a GPU but the override gives compute one; every container stops fast (init); the
gateway listens on all interfaces and publishes its port; Redis is wired.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pipellm.services import cli
from pipellm.shared import default_model, demo_model, transport
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.settings import config_from_args

# PyYAML comes with transformers (the `test` extra); without it these checks cannot run at all.
yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse compose.yaml")

ROOT = Path(__file__).resolve().parents[1]
PIPELLM = cli.SERVICES  # gateway, tokenizer, compute, detokenizer
CHANNELS = ("tokenizer", "compute", "control", "detokenizer", "gateway")
WILDCARD_HOSTS = ("*", "0.0.0.0")
CONFIG_ENV = {"PIPELLM_" + f.name.upper()
              for cls in (EngineConfig, ServiceConfig) for f in dataclasses.fields(cls)}
OTHER_PIPELLM_ENV = {demo_model.ENV_VAR, default_model.ENV_VAR}  # read there, not config fields
COMPUTE_ONLY = {"device"}  # engine settings no other service reads
Parsed = dict[str, tuple[EngineConfig, ServiceConfig]]  # per service, its parsed configs
GPU = "x-gpu-override"  # where load_compose puts compose.gpu.yaml
_ADDR = re.compile(r"tcp://(?P<host>[^:/\s]+):(?P<port>\d+)")


def load_compose() -> dict:
    """compose.yaml, with the GPU override file under the key GPU."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))
    compose[GPU] = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text(encoding="utf-8"))
    return compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


# --- who binds and who connects, read from the code ------------------------------------------


def _transport_calls(tree: ast.AST):
    """(channel, bind) for each `Sender|Receiver|AsyncSender|AsyncReceiver(ctx, svc.addr("x"),
    [bind=...])` in a module; without bind=, the class's own default."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("Sender", "Receiver", "AsyncSender", "AsyncReceiver")):
            continue
        addr = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(addr, ast.Call) and isinstance(addr.func, ast.Attribute)
                and addr.func.attr == "addr" and isinstance(addr.args[0], ast.Constant)):
            continue
        cls = getattr(transport, node.func.id)
        bind = inspect.signature(cls).parameters["bind"].default
        for kw in node.keywords:
            if kw.arg == "bind":
                bind = ast.literal_eval(kw.value)
        yield addr.args[0].value, bind


def _advertises_gateway_addr() -> bool:
    """Whether the gateway sends its own `svc.addr("gateway")` as each request's reply_to
    (a `reply_to=` keyword, or the reply address argument of `tokenize_requests`)."""
    def is_gateway_addr(node) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "addr" and ast.literal_eval(node.args[0]) == "gateway")

    for path in (ROOT / "pipellm" / "services" / "gateway").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.keyword) and node.arg == "reply_to" and is_gateway_addr(
                    node.value):
                return True
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "tokenize_requests"
                    and any(is_gateway_addr(a) for a in node.args[1:2])):
                return True
    return False


def socket_roles() -> dict[str, dict[str, str]]:
    """{service: {channel: "bind" | "connect"}}. Services holding a `Senders` (replies by
    address) connect to the reply address the gateway advertises: its gateway channel."""
    roles: dict[str, dict[str, str]] = {}
    for name in PIPELLM:
        source = (ROOT / "pipellm" / "services" / name / "service.py").read_text(encoding="utf-8")
        tree = ast.parse(source)
        roles[name] = {ch: "bind" if bind else "connect" for ch, bind in _transport_calls(tree)}
        if re.search(r"\bSenders\(", source):
            assert _advertises_gateway_addr(), "replies no longer go to svc.addr('gateway')"
            roles[name].setdefault("gateway", "connect")
    return roles


def test_socket_roles_match_the_design():
    """The table in compose.yaml's header; if the code changes, compose.yaml must follow."""
    assert socket_roles() == {
        "gateway": {"tokenizer": "bind", "control": "connect", "gateway": "bind"},
        "tokenizer": {"tokenizer": "connect", "compute": "connect", "gateway": "connect"},
        "compute": {"compute": "bind", "control": "bind", "detokenizer": "connect",
                    "gateway": "connect"},
        "detokenizer": {"detokenizer": "bind", "control": "connect", "gateway": "connect"},
    }


# --- parsing each command line with the real CLI ---------------------------------------------


def parse_serve(name: str, service: dict) -> tuple[EngineConfig, ServiceConfig]:
    """Run `pipellm <command[1:]>` through pipellm.services.cli.main, in the container's
    environment, with the serve step replaced by a stub: the real parser, nothing started."""
    command = service.get("command")
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), \
        f"{name}: command must be a list of strings: {command!r}"
    assert command[:3] == ["pipellm", "service", name], f"{name}: runs {command[:3]}"
    captured = []
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("PIPELLM_") or k == "REDIS_URL"]:
            mp.delenv(key)  # only what the container sets
        for key, value in environment(service).items():
            mp.setenv(key, value)
        mp.setattr(cli, "_service", lambda args: captured.append(args) or 0)
        try:
            rc = cli.main(command[1:])
        except SystemExit as e:  # argparse: an unknown flag, a bad value
            raise AssertionError(f"{name}: {command} does not parse (exit {e.code})") from e
        except ValueError as e:  # a PIPELLM_* value of the wrong type (read as the default)
            raise AssertionError(f"{name}: {e}") from e
    assert rc == 0 and len(captured) == 1 and captured[0].service == name
    args = captured[0]
    try:
        return (config_from_args(EngineConfig, args, model=args.model),
                config_from_args(ServiceConfig, args))
    except ValueError as e:
        raise AssertionError(f"{name}: {e}") from e


def parse_all(compose: dict) -> Parsed:
    return {name: parse_serve(name, compose["services"][name]) for name in PIPELLM}


# --- the checks ------------------------------------------------------------------------------


def check_services(compose: dict) -> None:
    services = compose.get("services") or {}
    assert set(services) == {"redis", *PIPELLM}, sorted(services)
    assert str(services["redis"].get("image", "")).split(":")[0] in ("redis", "library/redis")
    for name in PIPELLM:
        build = services[name].get("build") or {}
        want = "compute" if name == "compute" else "slim"  # only compute needs torch
        assert build.get("context") == "." and build.get("target") == want, \
            f"{name}: builds {build}, not the Dockerfile's {want} target"
        assert "redis" in (services[name].get("depends_on") or {}), f"{name}: depends_on redis"
    images = {services[n].get("image") for n in PIPELLM if n != "compute"}
    assert len(images) == 1 and services["compute"].get("image") not in images, \
        "one slim image for gateway, tokenizer, detokenizer; another for compute"
    for name in services:  # SIGTERM reaches the process: `stop` takes < 1 s, not 10
        assert services[name].get("init") is True, f"{name}: no init: true"


def check_env_names(compose: dict) -> None:
    for name in PIPELLM:
        for key in environment(compose["services"][name]):
            assert key != "REDIS_URL", f"{name}: reads PIPELLM_REDIS_URL, not {key}"
            assert key in CONFIG_ENV | OTHER_PIPELLM_ENV, f"{name}: {key} is no pipellm setting"


def check_zmq(compose: dict, parsed: Parsed) -> None:
    services = compose["services"]
    names = {name: {name, services[name].get("hostname")} - {None} for name in services}
    # replies go to the address the gateway advertises (its own), whatever the others set
    advertised = _addr(parsed["gateway"][1], "gateway", "gateway")
    binds: dict[str, tuple[str, int]] = {}  # channel -> (service, port)
    dials: list[tuple[str, str, str]] = []  # service, channel, address
    for name, roles in socket_roles().items():
        svc = parsed[name][1]
        for channel, role in roles.items():
            if role == "connect":
                dials.append((name, channel, advertised if channel == "gateway"
                              else _addr(svc, name, channel)))
                continue
            addr = _addr(svc, name, channel)
            host, port = _host_port(addr)
            assert host in WILDCARD_HOSTS or host in names[name], \
                f"{name} binds {channel} on {addr}: not one of its own interfaces"
            assert channel not in binds, f"{channel} bound twice: {binds[channel][0]}, {name}"
            assert port not in {p for s, p in binds.values() if s == name}, \
                f"{name} binds port {port} twice"
            binds[channel] = (name, port)
    assert set(binds) == set(CHANNELS), f"channels nobody binds: {set(CHANNELS) - set(binds)}"
    for name, channel, addr in dials:
        host, port = _host_port(addr)
        targets = [s for s, aliases in names.items() if host in aliases]
        assert targets, f"{name} connects {channel} to {addr}: {host!r} is no service"
        assert (targets[0], port) == binds[channel], \
            f"{name} connects {channel} to {addr}, but {binds[channel][0]} binds it on port " \
            f"{binds[channel][1]}"
    assert {c for _, c, _ in dials} == set(CHANNELS), "a channel nobody connects to"


def _addr(svc: ServiceConfig, name: str, channel: str) -> str:
    try:
        return svc.addr(channel)
    except ValueError as e:  # neither --<channel>-addr nor --run-dir
        raise AssertionError(f"{name}: {e}") from e


def _host_port(addr: str) -> tuple[str, int]:
    m = _ADDR.fullmatch(addr)
    assert m, f"{addr!r} is not tcp://host:port (containers share no ipc sockets)"
    return m["host"], int(m["port"])


def check_redis(compose: dict, parsed: Parsed) -> None:
    for name, (_, svc) in parsed.items():
        url = urlsplit(svc.redis_url)
        assert url.scheme == "redis" and url.hostname == "redis" and (url.port or 6379) == 6379, \
            f"{name}: --redis-url {svc.redis_url!r} is not the redis service"


def check_same_model(compose: dict, parsed: Parsed) -> None:
    """All four see the same model and engine settings (context length, vocab, predictor key),
    and that model is the file the images carry."""
    engines = {name: dataclasses.replace(engine, **{f: "" for f in COMPUTE_ONLY})
               for name, (engine, _) in parsed.items()}
    assert len(set(engines.values())) == 1, f"engine settings differ: {engines}"
    model = engines["gateway"].model
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    m = re.search(rf"^ENV\b[^#]*?\b{default_model.ENV_VAR}=(\S+)", dockerfile, re.M | re.S)
    assert m, f"Dockerfile sets no {default_model.ENV_VAR}"
    assert model == f"{m[1]}/{default_model.FILE_NAME}", \
        f"--model {model!r} is not the default model the images carry"
    assert re.search(r"^RUN .*python -m pipellm.shared.default_model", dockerfile, re.M), \
        "Dockerfile does not fetch the default model"


def check_gpu(compose: dict, parsed: Parsed) -> None:
    """compose.yaml runs anywhere (no device reservations, compute's --device auto); the GPU
    override reserves one NVIDIA GPU for compute alone."""
    def devices(file: dict, name: str) -> list:
        deploy = ((file.get("services") or {}).get(name) or {}).get("deploy") or {}
        return ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []

    assert not any(devices(compose, n) for n in compose["services"]), \
        "compose.yaml reserves a device: it would not start on a machine without one"
    assert parsed["compute"][0].device == "auto", "compute's --device must stay auto"
    gpus = [d for d in devices(compose[GPU], "compute") if d.get("driver") == "nvidia"
            and "gpu" in (d.get("capabilities") or []) and d.get("count") == 1]
    assert len(gpus) == 1, "compose.gpu.yaml reserves no nvidia GPU (count 1) for compute"
    assert set(compose[GPU]["services"]) == {"compute"}, "only compute needs a GPU"


def check_gateway_port(compose: dict, parsed: Parsed) -> None:
    svc = parsed["gateway"][1]
    assert svc.host in ("0.0.0.0", "::", ""), f"gateway listens on {svc.host}: unreachable"
    published = []
    for port in compose["services"]["gateway"].get("ports") or []:
        if isinstance(port, dict):
            published.append((str(port.get("published")), int(port["target"])))
        else:
            *_, outside, inside = str(port).split(":")
            published.append((outside, int(inside.split("/")[0])))
    assert (str(svc.port), svc.port) in published, \
        f"gateway serves on {svc.port}, publishes {published}"


def check_all(compose: dict) -> None:
    check_services(compose)
    check_env_names(compose)
    parsed = parse_all(compose)
    for check in (check_zmq, check_redis, check_same_model, check_gpu, check_gateway_port):
        check(compose, parsed)


# --- the tests -------------------------------------------------------------------------------


def test_services(compose):
    check_services(compose)


def test_env_names(compose):
    check_env_names(compose)


def test_every_command_parses(compose):
    parsed = parse_all(compose)
    assert set(parsed) == set(PIPELLM)


@pytest.mark.parametrize("check", [check_zmq, check_redis, check_same_model, check_gpu,
                                   check_gateway_port], ids=lambda c: c.__name__)
def test_wiring(compose, check):
    check(compose, parse_all(compose))


def _with(compose: dict, name: str, **changes) -> dict:
    """A copy of compose with service `name`'s keys changed (None: removed)."""
    broken = copy.deepcopy(compose)
    service = broken["services"][name]
    for key, value in changes.items():
        if value is None:
            service.pop(key, None)
        else:
            service[key] = value
    return broken


def _flag(compose: dict, name: str, flag: str, value: str) -> dict:
    command = list(compose["services"][name]["command"])
    if flag in command:
        command[command.index(flag) + 1] = value
    else:
        command += [flag, value]
    return _with(compose, name, command=command)


BROKEN = {
    "tokenizer dials the wrong port": lambda c: _flag(
        c, "tokenizer", "--compute-addr", "tcp://compute:5999"),
    "tokenizer dials the wrong service": lambda c: _flag(
        c, "tokenizer", "--compute-addr", "tcp://detokenizer:5556"),
    "a connecting side dials a wildcard": lambda c: _flag(
        c, "detokenizer", "--control-addr", "tcp://*:5557"),
    "gateway advertises a wildcard reply address": lambda c: _flag(
        c, "gateway", "--gateway-addr", "tcp://*:5559"),
    "compute binds another host's address": lambda c: _flag(
        c, "compute", "--compute-addr", "tcp://gateway:5556"),
    "an ipc address": lambda c: _flag(c, "compute", "--compute-addr", "ipc:///tmp/compute.sock"),
    "a missing address": lambda c: _with(
        c, "detokenizer", command=c["services"]["detokenizer"]["command"][:3]),
    "gateway on loopback only": lambda c: _flag(c, "gateway", "--host", "127.0.0.1"),
    "a flag the CLI lacks": lambda c: _flag(c, "compute", "--no-such-flag", "1"),
    "a bad flag value": lambda c: _flag(c, "gateway", "--port", "http"),
    "a bad env var value": lambda c: _with(c, "compute", environment={
        **environment(c["services"]["compute"]), "PIPELLM_MAX_RUNNING": "many"}),
    "an unknown env var": lambda c: _with(c, "compute", environment={
        **environment(c["services"]["compute"]), "PIPELLM_NO_SUCH_SETTING": "1"}),
    "REDIS_URL, which serve does not read": lambda c: _with(
        c, "gateway", environment={"REDIS_URL": "redis://redis:6379/0"}),
    "engine settings differ": lambda c: _flag(c, "tokenizer", "--max-model-len", "512"),
    "no GPU reservation": lambda c: {**c, GPU: {"services": {"compute": {}}}},
    "a GPU required": lambda c: _with(c, "compute", deploy=c[GPU]["services"]["compute"]["deploy"]),
    "compute on CPU": lambda c: _flag(c, "compute", "--device", "cpu"),
    "compute on CUDA": lambda c: _flag(c, "compute", "--device", "cuda"),
    "no init": lambda c: _with(c, "detokenizer", init=None),
    "gateway on the compute image": lambda c: _with(
        c, "gateway", build={"context": ".", "target": "compute"}),
    "a model the images lack": lambda c: {**c, "services": {
        n: ({**v, "environment": {**environment(v), "PIPELLM_MODEL": "/models/x.gguf"}}
            if n != "redis" else v) for n, v in c["services"].items()}},
    "gateway port not published": lambda c: _with(c, "gateway", ports=["8080:8080"]),
    "a service missing": lambda c: {**c, "services": {
        k: v for k, v in c["services"].items() if k != "detokenizer"}},
}


@pytest.mark.parametrize("breakage", list(BROKEN))
def test_checks_catch_a_broken_compose(compose, breakage):
    check_all(compose)  # the real file passes...
    with pytest.raises(AssertionError):  # ...and this copy of it does not
        check_all(BROKEN[breakage](compose))


def test_slim_services_run_without_torch(demo_model_dir):
    """What the slim image runs (gateway, tokenizer, detokenizer; their settings resolved as at
    start-up) imports neither torch nor the other compute packages."""
    script = (
        "import sys\n"
        "for m in ('torch', 'triton', 'safetensors', 'ninja'): sys.modules[m] = None\n"
        "from pipellm.services import cli\n"
        "from pipellm.services.tokenizer.service import Tokenizer\n"
        "import pipellm.services.gateway.service, pipellm.services.detokenizer.service\n"
        "for name in ('gateway', 'tokenizer', 'detokenizer'):\n"
        "    args = cli.build_parser().parse_args(['service', name, '--model', sys.argv[1]])\n"
        "    engine, svc = cli._configs(args)\n"
        "Tokenizer(engine)\n")
    out = subprocess.run([sys.executable, "-c", script, str(demo_model_dir)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_compute_image_carries_the_built_kernels():
    """The compute target compiles the C++ CPU kernels as the user it runs as, from the
    installed package (the paths compute loads them from), so a container loads them rather
    than compiling for minutes (tests/test_docker.py checks compute's log for real)."""
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    stage = dockerfile.split("AS compute", 1)[1].split("\nFROM ", 1)[0]
    build = re.search(r"^RUN cd /tmp && python -m pipellm\.kernels\.cpu$", stage, re.M)
    assert build, "the compute target does not build the C++ CPU kernels"
    users = re.findall(r"^USER (\S+)", stage[:build.start()], re.M)
    assert users and users[-1] == "pipellm", "the kernels are not built as the runtime user"
    assert "USER" not in stage[build.end():], "the runtime user changes after the build"
    assert "libpython3-dev" in stage, "no Python headers where the base image lacks them"
