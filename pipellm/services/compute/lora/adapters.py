"""The LoRA adapters an engine serves, loaded and unloaded at run time.

Invariant: `names` are the adapters a new request may name; an unloaded adapter leaves `names` at
once but keeps its weights until no request held (or in the step in flight) uses it, so the
requests running with it finish as they began.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipellm.shared.lora import LoraModule


class Adapters:
    def __init__(self, runner, max_rank: int):
        """`runner`: the engine's ModelRunner (its model holds the adapters' weights; a
        runner without a model, the simulator's, serves none)."""
        self.runner, self.max_rank = runner, max_rank
        self.unloading: set[str] = set()  # unloaded adapters some request still uses

    @property
    def names(self) -> frozenset[str]:
        """The adapters a new request may name: the model's, less those being unloaded."""
        model = getattr(self.runner, "model", None)
        return frozenset() if model is None else model.lora_names - self.unloading

    def load(self, module: LoraModule) -> None:
        """Serve adapter `module` from now on (LoraError if it cannot be served). A name still
        being unloaded is replaced at once."""
        model = self.runner.model
        if module.name in model.lora_names:
            self.unloading.discard(module.name)
            self.runner.detach_adapter(module.name)
        self.runner.attach_adapter(module, self.max_rank)

    def unload(self, name: str, used: Iterable[str]) -> None:
        """Stop serving adapter `name`: requests naming it are refused from now on. `used`: the
        adapters the requests held use."""
        self.unloading.add(name)
        self.release(used)

    def release(self, used: Iterable[str]) -> None:
        """Detach the adapters being unloaded that are not in `used`."""
        for name in self.unloading - set(used):
            self.runner.detach_adapter(name)
            self.unloading.discard(name)

    def info(self, running, waiting, max_loras: int) -> dict[str, str]:
        """vLLM's lora_requests_info labels: the adapters of the `running` and of the `waiting`
        sequences (comma-separated, sorted), --max-loras and the ones loaded."""
        def names(seqs) -> str:
            return ",".join(sorted({q.params.lora_name for q in seqs} - {""}))

        return {"lora_running": names(running), "lora_waiting": names(waiting),
                "max_lora": str(max_loras), "lora_loaded": ",".join(sorted(self.names))}
