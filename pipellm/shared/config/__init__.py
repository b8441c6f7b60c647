"""Settings: frozen dataclasses resolved once at start-up from CLI flags and env vars.

Every setting `foo_bar` is the flag `--foo-bar` and the env var `PIPELLM_FOO_BAR` (flag > env
var > default; the machinery is `pipellm/shared/settings.py`); where vLLM has the same thing, its
flag name works too. This package is the only place that declares them, a module per config class.
"""

from pipellm.shared.config.choices import (
    Admission,
    BackendName,
    Batching,
    ConvertName,
    KVPolicyName,
    RunnerName,
    SchedulingPolicyName,
)
from pipellm.shared.config.engine import EngineConfig
from pipellm.shared.config.scheduler import SchedulerConfig, step_budget
from pipellm.shared.config.service import (
    TOOL_CALL_PARSERS,
    ServiceConfig,
    auto_tokenizer_workers,
    check_replicas,
    replica_master_port,
)
from pipellm.shared.config.sim import SimConfig

__all__ = ["TOOL_CALL_PARSERS", "Admission", "BackendName", "Batching", "ConvertName",
           "EngineConfig", "KVPolicyName", "RunnerName", "SchedulerConfig", "step_budget",
           "SchedulingPolicyName", "ServiceConfig", "SimConfig", "auto_tokenizer_workers",
           "check_replicas", "replica_master_port"]
