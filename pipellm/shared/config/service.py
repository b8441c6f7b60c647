"""The server's settings: the HTTP API and the wiring of the services."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pipellm.shared.config.choices import LORA, SCHEDULING, SERVER, WIRING
from pipellm.shared.config.engine import EngineConfig
from pipellm.shared.settings import setting

# pipellm/services/gateway/tool_formats.PARSERS' names (tests/test_tool_formats.py checks it)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
PENDING_PER_SLOT = 8  # --max-pending by device: requests held per slot of the running batch


@dataclass(frozen=True)
class ServiceConfig:
    """The HTTP server and the wiring of the four services. Empty addresses: ipc sockets
    under `run_dir`."""

    host: str = setting("127.0.0.1", "address the HTTP server listens on", group=SERVER)
    port: int = setting(8000, "HTTP port", group=SERVER)
    served_model_name: str = setting("", "the model's name in the API; empty: the model "
                                     "directory's (GGUF file's) name", group=SERVER)
    api_key: str = setting("", "if set, /v1/* and the utility endpoints need the header "
                           "'Authorization: Bearer KEY'", group=SERVER)
    allowed_origins: str = setting("*", "CORS: origins allowed to call the API from a browser, "
                                   "comma-separated or a JSON list; empty: no CORS headers",
                                   group=SERVER)
    seed: int | None = setting(None, "requests without a seed draw theirs from this seed "
                               "(reproducible runs); unset: from the OS", group=SERVER)
    max_pending: int = setting(512, "requests in flight at the gateway before it answers 429; "
                               "by device: 8 per slot of the running batch (--max-running) "
                               "on each data-parallel rank", group=SERVER, by_device=True)
    strict_request_fields: bool = setting(False, "answer a request key the API does not know "
                                          "with a 400; by default it is ignored and logged, "
                                          "as vLLM does", group=SERVER)
    enable_auto_tool_choice: bool | None = setting(
        None, "tool_choice \"auto\": the model decides whether to call tools; its output is "
        "parsed by --tool-call-parser; unset: on unless --tool-call-parser is given without "
        "it (vLLM's rule)", group=SERVER)
    tool_call_parser: str = setting("", "how the model writes tool calls: hermes "
                                    "(<tool_call>{...}</tool_call>), llama3_json, mistral, "
                                    "pythonic or qwen3_coder; empty: "
                                    "the one its chat template writes (hermes where the "
                                    "template renders no tools: they are then described in "
                                    "the system message, llama.cpp's fallback)", group=SERVER)
    reasoning_parser: str = setting("", "split a reasoning model's chat answers into reasoning "
                                    "and content: qwen3 (reasoning only after an opening "
                                    "<think>) or deepseek_r1 (reasoning until </think>); "
                                    "SGLang's deepseek-r1 and qwen3-thinking too", group=SERVER)
    default_chat_template_kwargs: str = setting(
        "", "a JSON object of chat template variables for every chat request (a request's "
        "chat_template_kwargs win key by key), e.g. '{\"enable_thinking\": false}'",
        group=SERVER)
    trust_request_chat_template: bool = setting(
        False, "let a chat request bring its own `chat_template` (vLLM's flag; without it such "
        "a request is a 400): templates render in a sandbox, but run as long as they loop",
        group=SERVER)
    allow_runtime_lora_updating: bool = setting(
        False, "with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true works too)", group=LORA)
    responses_store_ttl: int = setting(
        7 * 86400, "seconds a stored /v1/responses response (store: true) stays in Redis "
        "after its last write, for previous_response_id, GET and background polling",
        group=SERVER)
    responses_store_max_bytes: int = setting(
        16 * 2**20, "largest stored response (its object, input and output); a larger one is "
        "answered but not stored (its `store` says false)", group=SERVER)
    max_body_bytes: int = setting(8 * 2**20, "largest request body, else 413", group=SERVER)
    max_prompt_bytes: int = setting(0, "largest prompt (UTF-8 bytes of the prompt, or of all "
                                    "chat messages), else 400; 0: 16 bytes per token of the "
                                    "context length, at least 64 KiB", group=SERVER)
    log_stats_interval: float = setting(
        10.0, "seconds between compute's stats lines in its log, as vLLM's engine logs them "
        "(prompt and generation throughput, running and waiting requests, KV cache usage, "
        "prefix cache hit rate), then where its steps' time went; 0: none", group=SERVER)
    disable_log_stats: bool = setting(False, "no stats lines (vLLM's flag)", group=SERVER)
    length_predictor: bool = setting(True, "predict output lengths (in Redis) and learn them "
                                     "as requests finish", group=SCHEDULING)
    redis_url: str = setting("", "Redis for request state and the length predictor; empty "
                             "with `pipellm serve`: an embedded redis-server", group=WIRING)
    redis_dir: str = setting("", "embedded Redis: persist here (learned lengths survive "
                             "restarts)", group=WIRING)
    run_dir: str = setting("", "where ipc sockets live; empty: a temporary directory",
                           group=WIRING)
    tokenizer_addr: str = setting("", "zmq: gateway PUSH (bind) -> tokenizers PULL",
                                  group=WIRING)
    compute_addr: str = setting("", "zmq: tokenizers PUSH -> compute PULL (bind)", group=WIRING)
    control_addr: str = setting("", "zmq: gateway, detokenizer PUSH -> compute PULL (bind): "
                                "aborts, stops", group=WIRING)
    detokenizer_addr: str = setting("", "zmq: compute PUSH -> detokenizer PULL (bind)",
                                    group=WIRING)
    gateway_addr: str = setting("", "zmq: detokenizer, tokenizers PUSH -> gateway PULL (bind)",
                                group=WIRING)
    tokenizer_workers: int = setting(0, "tokenizer processes; 0: 2 with 4 or more cores, else 1",
                                     group=WIRING)
    request_ttl_s: int = setting(3600, "seconds a finished request's state stays in Redis",
                                 group=WIRING)
    heartbeat_s: float = setting(0.5, "seconds between each service's heartbeats", group=WIRING)
    gc_young_threshold: int = setting(50_000, "net allocations between the garbage collector's "
                                      "young collections in each service once started "
                                      "(pipellm/shared/heap.py; CPython's default: 700)",
                                      group=WIRING)
    data_parallel_size: int = setting(
        1, "compute processes, one per device (vLLM's --data-parallel-size): with CUDA, "
        "devices 0..N-1 of those visible; on a CPU each gets its share of the cores. A "
        "tokenizer sends each request to the one with the lowest predicted KV demand; with "
        "--nnodes, each is a group across the machines and every node takes the same D",
        group=WIRING)
    data_parallel_routing: str = setting(
        "auto", "how a tokenizer picks the compute process: predicted-load (the lowest "
        "predicted KV demand), predicted-load-affinity (the same, preferring the one that "
        "cached the prompt's prefix), cache-aware (SGLang router's rule), round-robin; auto: "
        "predicted-load-affinity with --enable-prefix-caching, else predicted-load",
        group=WIRING)
    data_parallel_rank: int = setting(0, "this compute process's rank (set by pipellm serve)",
                                      group=WIRING)
    server_id: str = setting("", "this server's name in Redis (its services' heartbeats and "
                             "engine stats), so that servers behind a router may share one "
                             "Redis; empty: `pipellm serve` takes <host>-<port>", group=WIRING)

    def __post_init__(self):
        if self.tool_call_parser not in ("", *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser:
            from pipellm.shared.reasoning import parser

            parser(self.reasoning_parser)  # ValueError naming the choices
        if self.default_chat_template_kwargs:
            try:
                kwargs = json.loads(self.default_chat_template_kwargs)
            except ValueError:
                kwargs = None
            if not isinstance(kwargs, dict):
                raise ValueError("--default-chat-template-kwargs must be a JSON object")
        if self.tokenizer_workers < 0:
            raise ValueError("--tokenizer-workers must be 0 (automatic) or more")
        from pipellm.shared.routing import POLICIES

        if self.data_parallel_routing not in ("auto", *POLICIES):
            raise ValueError(f"--data-parallel-routing must be auto or one of "
                             f"{', '.join(POLICIES)}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError("--data-parallel-size must be at least 1 (and a rank below it)")
        if self.log_stats_interval < 0:
            raise ValueError("--log-stats-interval must be 0 (none) or more")
        if self.gc_young_threshold < 1:
            raise ValueError("--gc-young-threshold must be at least 1")
        if self.max_prompt_bytes < 0:
            raise ValueError("--max-prompt-bytes must be 0 (automatic) or more")
        self.origins()  # a malformed --allowed-origins fails at start-up

    @staticmethod
    def pending_by_device(max_running: int, data_parallel_size: int) -> int:
        """--max-pending left unset: a queue of 7 running batches' worth behind the running
        ones, so a burst the size of a benchmark's (1,000 at once) is queued, as vLLM and
        SGLang queue it, not refused."""
        return PENDING_PER_SLOT * max_running * data_parallel_size

    def prompt_bytes_limit(self, max_model_len: int) -> int:
        """The prompt size cap in bytes: --max-prompt-bytes, or when 0, 16 bytes per token of
        the context length but at least 64 KiB (tokens are rarely over 8 bytes of text)."""
        return self.max_prompt_bytes or max(16 * max_model_len, 64 * 1024)

    @property
    def tokenizers(self) -> int:
        """Tokenizer processes to run: --tokenizer-workers, or by the machine's cores if 0."""
        return self.tokenizer_workers or auto_tokenizer_workers()

    def origins(self) -> frozenset[str]:
        """--allowed-origins: comma-separated, or a JSON list as vLLM takes it; "*" for any."""
        value = self.allowed_origins.strip()
        if not value.startswith("["):
            items = value.split(",")
        else:
            try:
                items = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--allowed-origins is not a JSON list: {exc}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError("--allowed-origins must be a list of strings")
        return frozenset(i.strip().rstrip("/") for i in items if i.strip())

    def routing_policy(self, prefix_caching: bool) -> str:
        """The routing policy's name (--data-parallel-routing, auto resolved)."""
        if self.data_parallel_routing != "auto":
            return self.data_parallel_routing
        return "predicted-load-affinity" if prefix_caching else "predicted-load"

    @property
    def server(self) -> str:
        """server_id, or "default" (services started alone without one)."""
        return self.server_id or "default"

    def addr(self, name: str, rank: int = 0) -> str:
        """The zmq address of channel `name` (tokenizer, compute, control, detokenizer,
        gateway); of compute process `rank`'s for compute and control: a given tcp address's
        port plus the rank, or its own ipc socket."""
        given = getattr(self, f"{name}_addr")
        if given and rank:
            host, _, port = given.rpartition(":")
            if not given.startswith("tcp://") or not port.isdigit():
                raise ValueError(f"--{name}-addr with --data-parallel-size needs tcp://HOST:PORT")
            return f"{host}:{int(port) + rank}"
        if given:
            return given
        if not self.run_dir:
            raise ValueError(f"--{name}-addr or --run-dir must be set")
        return f"ipc://{self.run_dir}/{name}{f'-{rank}' if rank else ''}.sock"


def auto_tokenizer_workers(cores: int | None = None) -> int:
    """Tokenizer workers by default: 2 with at least 4 cores (usable by this process), else 1
    (on 2 cores a second worker would only take CPU from compute)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return 2 if cores >= 4 else 1


def replica_master_port(engine: EngineConfig, replica: int) -> int:
    """The port where data-parallel replica `replica`'s tensor-parallel ranks meet:
    --master-port + replica (each replica is its own torch.distributed group, its store on
    node 0); 0 without --master-port (one machine: each replica's store takes a free port).
    Node 0's supervisor and the other nodes' tp_node both derive it here."""
    return engine.master_port + replica if engine.master_port else 0


def check_replicas(engine: EngineConfig, data_parallel_size: int) -> None:
    """ValueError, one line, where --data-parallel-size replicas would meet on a port past
    65535 (replica_master_port)."""
    last = replica_master_port(engine, data_parallel_size - 1)
    if last > 65535:
        raise ValueError(f"--master-port {engine.master_port} with --data-parallel-size "
                         f"{data_parallel_size}: replica d meets on --master-port + d, and "
                         f"{last} is past 65535")
