"""Settings: one flag and env var per field, nested configs (--sim-*), children reproduce them,
and the context length resolved once at start-up."""

import argparse

import pytest

from services.compute.backend import resolve
from shared.config import EngineConfig, ServiceConfig, SimConfig
from shared.model_config import served_context
from shared.settings import add_config_args, config_from_args, env_for, settings, with_settings


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
