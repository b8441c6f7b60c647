"""The one place a backend (`--backend`) is chosen: the model it serves, its runner, the engine.

- `torch`: the model's weights on a CPU or GPU (`runner.ModelRunner`).
- `sim`: no weights, a modelled GPU (`sim.runner.SimRunner`): the real scheduler and KV
  allocator, step times from a roofline cost model.

A runner has `model_config`, `max_model_len`, `capacity` (KV slots), `launch(step, prev)`
(returning a handle whose `result()` is the step's StepSample), `asynchronous` (whether
launch returns before the step ran) and `simulated` (no model: nothing to build or warm up);
the engine takes one (`LLMEngine(config, runner)`) and
never asks which kind it is.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

from pipellm.services.compute import sim
from pipellm.shared.config import BackendName, EngineConfig, step_budget
from pipellm.shared.model_config import ModelConfig, context_length


def served_model(config: EngineConfig) -> tuple[ModelConfig, int]:
    """The ModelConfig a backend runs and its context length (tokens a request may span): the
    model file's, or with the sim backend the simulated model's context (vocab and EOS still
    from the model file, whose tokenizer the other services use)."""
    simulated = config.backend == BackendName.SIM
    mc = sim.model_config(config) if simulated else ModelConfig.from_path(config.model)
    return mc, context_length(mc, config.max_model_len)


def resolve(config: EngineConfig) -> EngineConfig:
    """`config` with --max-model-len resolved to the served context length, once at start-up,
    so that every service (gateway, tokenizers, compute) enforces the same number; a bad
    --sim-* value, or a --tensor-parallel-size the model cannot be split by, fails here
    (ValueError), not in a restarting child."""
    if config.backend == BackendName.SIM:
        sim.check_config(config)
    mc, context = served_model(config)
    if config.tensor_parallel_size > 1:  # shapes it cannot split, weights it cannot run
        from pipellm.services.compute.runner import resolve_device
        from pipellm.services.compute.tp.group import refuse

        refuse(config, mc, resolve_device(config.device))
    return dataclasses.replace(config, max_model_len=context)


def device_step_budget(device: str, backend: str) -> dict[str, int]:
    """`step_budget` of the device --device names (the CPU's for the sim backend, and for a
    slim service without torch, which runs no step). Where no GPU can be meant (--device cpu,
    or a CPU build of torch) it is decided without importing torch: `pipellm up` itself
    imports none otherwise."""
    if backend == BackendName.SIM or device == "cpu" or not _torch_may_have_cuda():
        return step_budget("cpu")
    import torch

    from pipellm.services.compute.runner import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        return step_budget("cpu")
    props = torch.cuda.get_device_properties(dev.index or 0)
    return step_budget("cuda", props.total_memory / 2**30, props.name)


def _torch_may_have_cuda() -> bool:
    """False for no torch (a slim service) or a CPU build ("2.13.0+cpu"), read from its
    metadata; else True (importing torch decides)."""
    try:
        return not importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def make_runner(config: EngineConfig):
    """The runner of `config.backend`; loads the weights (torch) or the cost model (sim)."""
    mc, context = served_model(config)
    if config.backend == BackendName.SIM:
        from pipellm.services.compute.sim.runner import SimRunner

        return SimRunner(config, mc, context)
    from pipellm.services.compute.runner import ModelRunner, resolve_device

    if config.tensor_parallel_size == 1:
        return ModelRunner(config, mc, context)
    from pipellm.services.compute.tp.group import start

    # spawns ranks 1..N-1, each building its ModelRunner
    ranks = start(config, mc, context, resolve_device(config.device))
    try:
        return ModelRunner(config, mc, context, ranks)
    except BaseException:
        ranks.abort()
        raise


def build_engine(config: EngineConfig, length_stores=None):
    """An LLMEngine on the runner of `config.backend` (`length_stores`: see LLMEngine)."""
    from pipellm.services.compute.engine import LLMEngine

    return LLMEngine(config, make_runner(config), length_stores)
