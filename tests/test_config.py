"""Settings: one flag and env var per field, nested configs (--sim-*), children reproduce them,
and the context length resolved once at start-up."""

import argparse

import pytest

from pipellm.services.compute.backend import resolve
from pipellm.shared.config import EngineConfig, ServiceConfig, SimConfig, step_budget
from pipellm.shared.model_config import served_context
from pipellm.shared.settings import (
    add_config_args,
    config_from_args,
    env_for,
    settings,
    with_settings,
)


def parse(argv: list[str], cls=EngineConfig):
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    return config_from_args(cls, parser.parse_args(argv))


def test_nested_sim_settings_are_flags_and_env_vars(monkeypatch):
    c = parse(["--backend", "sim", "--sim-gpu", "a100", "--sim-eff-bw", "0.5"])
    assert c.sim == SimConfig(gpu="a100", eff_bw=0.5) and c.backend == "sim"
    monkeypatch.setenv("PIPELLM_SIM_CLOCK", "virtual")
    assert parse([]).sim.clock == "virtual"
    assert parse(["--sim-clock", "real"]).sim.clock == "real"  # a flag beats the env var


def test_env_for_reproduces_a_config_in_a_child(monkeypatch):
    c = with_settings(EngineConfig(), model="m", sim_model="llama-2-7b", sim_overhead_ms=2.5,
                      max_running=7)
    for name, value in env_for(c).items():
        monkeypatch.setenv(name, value)
    assert parse([]) == c
    svc = ServiceConfig(length_predictor=False, port=9)
    for name, value in env_for(svc).items():
        monkeypatch.setenv(name, value)
    assert parse([], ServiceConfig) == svc


def test_with_settings_names_settings_as_flags_and_refuses_unknown_ones():
    c = with_settings(EngineConfig(), sim_kv_dtype="int8", kv_policy="max")
    assert c.sim.kv_dtype == "int8" and c.scheduler.kv_policy == "max" and c.sim.gpu == "h100"
    assert settings(c)["sim_kv_dtype"] == "int8"
    with pytest.raises(TypeError, match="no setting sim_gpus"):
        with_settings(c, sim_gpus="a100")
    with pytest.raises(ValueError, match="--sim-clock"):
        with_settings(c, sim_clock="sometimes")


def test_context_length_resolved_once_for_every_service(demo_model_dir):
    """`pipellm` resolves --max-model-len to what compute serves; gateway and tokenizers read
    that number (served_context), so all three agree, for both backends."""
    torch_cfg = EngineConfig(model=str(demo_model_dir))
    model_limit = served_context(torch_cfg)  # unresolved: the model file's
    assert resolve(torch_cfg).max_model_len == model_limit
    assert resolve(with_settings(torch_cfg, max_model_len=10**9)).max_model_len == model_limit
    assert served_context(resolve(with_settings(torch_cfg, max_model_len=100))) == 100
    sim = resolve(with_settings(torch_cfg, backend="sim", sim_model="llama-2-7b"))
    assert served_context(sim) == sim.max_model_len == 4096  # the simulated model's context
    assert resolve(sim) == sim


def test_step_budget_is_vllms_on_a_gpu_and_the_defaults_on_a_cpu():
    assert step_budget("cpu") == {"max_batched_tokens": 512, "max_running": 256}
    assert step_budget("cuda", 139.8, "NVIDIA H200") == {"max_batched_tokens": 8192,
                                                        "max_running": 1024}
    assert step_budget("cuda", 79.3, "NVIDIA A100-SXM4-80GB") == {"max_batched_tokens": 2048,
                                                                 "max_running": 256}
    assert step_budget("cuda", 23.6, "NVIDIA L4")["max_batched_tokens"] == 2048


def test_a_command_line_leaves_the_step_budget_to_the_device(monkeypatch):
    """--max-batched-tokens and --max-running unset: the device's (a GPU's budget here, as on
    an H200); set by a flag or an env var: as set, the running batch never above the step's
    tokens; code that builds a config, and the help, say what applies."""
    from pipellm.services import cli
    from pipellm.services.compute import backend

    gpu = step_budget("cuda", 139.8, "NVIDIA H200")
    monkeypatch.setattr(backend, "device_step_budget", lambda device, kind: dict(gpu))
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    assert "(default: 'by device')" in " ".join(parser.format_help().split())

    def config(argv):
        args = parser.parse_args(argv)
        return config_from_args(EngineConfig, args, **cli._by_device(args)).scheduler

    assert (config([]).max_batched_tokens, config([]).max_running) == (8192, 1024)
    small = config(["--max-num-batched-tokens", "512"])
    assert (small.max_batched_tokens, small.max_running) == (512, 512)
    assert config(["--max-running", "64"]).max_batched_tokens == 8192
    monkeypatch.setenv("PIPELLM_MAX_RUNNING", "32")  # an env var sets it too (children)
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    assert config([]).max_running == 32
    assert EngineConfig().scheduler.max_batched_tokens == 512  # built in code: the default
    assert config_from_args(EngineConfig, parser.parse_args([])).scheduler.max_batched_tokens \
        == 512  # no device asked: the field's default


def test_max_pending_left_unset_follows_the_running_batch(monkeypatch, demo_model_dir):
    """--max-pending unset: 8 per slot of the running batch the engine got, times the
    data-parallel ranks (an H200's 1024 running: 8192, so a 1,000-request burst is queued);
    set by a flag or an env var: as set; built in code: the field's default."""
    from pipellm.services import cli
    from pipellm.services.compute import backend

    gpu = step_budget("cuda", 139.8, "NVIDIA H200")
    monkeypatch.setattr(backend, "device_step_budget", lambda device, kind: dict(gpu))

    def pending(argv):
        return cli._configs(cli.build_parser().parse_args(
            ["service", "gateway", "--model", str(demo_model_dir), *argv]))[1].max_pending

    assert pending([]) == 8 * 1024
    assert pending(["--max-running", "16", "--data-parallel-size", "2"]) == 8 * 16 * 2
    assert pending(["--max-pending", "3"]) == 3
    monkeypatch.setenv("PIPELLM_MAX_PENDING", "5")  # how children get the parent's value
    assert pending([]) == 5
    assert ServiceConfig().max_pending == 512


def test_gc_young_threshold_must_be_positive():
    assert ServiceConfig().gc_young_threshold == 50_000
    with pytest.raises(ValueError, match="--gc-young-threshold"):
        ServiceConfig(gc_young_threshold=0)


def test_the_open_files_limit_is_raised_to_the_target_or_the_hard_limit(monkeypatch, caplog):
    import resource

    from pipellm.shared import open_files

    calls = []
    monkeypatch.setattr(resource, "setrlimit", lambda kind, pair: calls.append(pair))
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert open_files.raise_open_files_limit() == 4096 and calls == [(4096, 4096)]
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, resource.RLIM_INFINITY))
    assert open_files.raise_open_files_limit() == 65535
    assert calls[-1] == (65535, resource.RLIM_INFINITY)
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (100_000, 200_000))
    assert open_files.raise_open_files_limit() == 100_000 and len(calls) == 2  # never lowered

    def refuse(kind, pair):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert open_files.raise_open_files_limit() == 1024
    assert "open-files limit stays 1024" in caplog.text


def test_a_cpu_build_of_torch_answers_the_step_budget_without_importing_it():
    """`pipellm up` imports no torch of its own: on a CPU build the device's budget is read
    from torch's metadata (this project's machines run torch 2.13.0+cpu)."""
    import importlib.metadata
    import subprocess
    import sys

    if not importlib.metadata.version("torch").endswith("+cpu"):
        pytest.skip("not a CPU build of torch")
    code = ("import sys; from pipellm.services import cli; "
            "a = cli.build_parser().parse_args(['serve']); "
            "print(cli._by_device(a), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "{'max_batched_tokens': 512, 'max_running': 256} False"
