"""The `pipellm` command: `pipellm serve [MODEL]` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipellm.shared.config import EngineConfig, ServiceConfig, check_replicas
from pipellm.shared.open_files import raise_open_files_limit
from pipellm.shared.settings import add_config_args, config_from_args, unset_by_device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipellm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run the engine in-process on some prompts")
    add_config_args(gen, EngineConfig)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    serve = sub.add_parser("serve", aliases=["up"], help="the whole server: Redis and the four "
                           "services, supervised (as `vllm serve MODEL`)",
                           description="Start the OpenAI-compatible server on MODEL.")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="model directory or GGUF "
                       "file (the same as --model)")
    batch = sub.add_parser("run-batch", help="an OpenAI batch file (JSON lines) through the "
                           "engine in-process, as vLLM's run_batch")
    batch.add_argument("-i", "--input-file", required=True, help="requests, one per line")
    batch.add_argument("-o", "--output-file", required=True, help="results, one per line")
    batch.add_argument("--served-model-name", default="", help="the model name requests give "
                       "(default: the model file's or directory's name)")
    add_config_args(batch, EngineConfig)
    add_config_args(batch, ServiceConfig, only=("enable_auto_tool_choice", "tool_call_parser",
                                                "reasoning_parser",
                                                "default_chat_template_kwargs",
                                                "trust_request_chat_template"))
    service = sub.add_parser("service", help="run one service (what each container runs)")
    service.add_argument("service", choices=SERVICES)
    for p in (serve, service):
        add_config_args(p, EngineConfig)
        add_config_args(p, ServiceConfig)
    from pipellm.services.compute.sim import roofline

    roof = sub.add_parser("roofline", help="decode roofline of a model on a GPU (sim backend)",
                          description=roofline.__doc__)
    roofline.add_args(roof)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command != "generate" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipellm.shared.model_config import ModelLoadError
    from pipellm.shared.tokenizer import TokenizerLoadError

    try:
        if args.command == "roofline":
            from pipellm.services.compute.sim import roofline

            return roofline.run(args)
        if args.command in ("serve", "up", "service"):  # children inherit it
            raise_open_files_limit()
        if args.command == "service":
            return _service(args)
        if args.command == "run-batch":
            return _run_batch(args)
        if args.command in ("serve", "up"):
            from pipellm.services.supervisor import up

            engine, svc = _configs(args)
            check_replicas(engine, svc.data_parallel_size)
            if engine.node_rank > 0:  # another machine's tensor-parallel ranks, no services
                from pipellm.services.compute.tp_node import serve_node

                return serve_node(engine, svc.data_parallel_size)
            _check_model(engine)
            return up(engine, svc)  # its banner says which sampling defaults apply
        return _generate(args)
    except (ModelLoadError, TokenizerLoadError, ValueError, OSError) as e:
        print(f"pipellm: error: {e}", file=sys.stderr)
        return 2


SERVICES = ("gateway", "tokenizer", "compute", "detokenizer")


def _by_device(args: argparse.Namespace) -> dict[str, int]:
    """The step budget's settings the command line left to the device (--max-batched-tokens,
    --max-running), the running batch never above the step's tokens."""
    unset = unset_by_device(EngineConfig, args)
    if not unset:
        return {}
    from pipellm.services.compute.backend import device_step_budget

    budget = device_step_budget(args.device, args.backend)
    tokens = budget["max_batched_tokens"] if "max_batched_tokens" in unset \
        else args.max_batched_tokens
    budget["max_running"] = min(budget["max_running"], tokens)
    return {k: v for k, v in budget.items() if k in unset}


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags; no --model means the default model (SmolLM2, else demo)."""
    from pipellm.shared import default_model

    model = getattr(args, "model_arg", None)
    if model and args.model and model != args.model:
        raise ValueError(f"two models given: {model} and --model {args.model}")
    model = model or args.model
    config = config_from_args(EngineConfig, args, model=model or default_model.resolve(),
                              **_by_device(args))
    from pipellm.shared.generation_config import GenerationDefaults

    GenerationDefaults.of(config)  # a bad --generation-config or override fails here
    from pipellm.services.compute.backend import resolve

    return resolve(config)  # raises ModelLoadError for a model that cannot be read


def _check_model(config: EngineConfig) -> None:
    """Raise (ModelLoadError, TokenizerLoadError, ValueError) if the model cannot be served,
    before any service starts: its config, tokenizer, chat template and tensor table."""
    from pipellm.shared.chat_template import load_chat_template
    from pipellm.shared.gguf.names import check_gguf
    from pipellm.shared.gguf.reader import is_gguf
    from pipellm.shared.tokenizer import load_tokenizer

    load_tokenizer(config.model)
    load_chat_template(config.model, config.chat_template)
    if config.pooling:
        from pipellm.shared.pooling import PoolingConfig

        PoolingConfig.resolve(config.model, config.pooler_config)  # a malformed config
    from pipellm.shared.scoring import ScoringConfig

    scoring = ScoringConfig.from_dir(config.model, config.hf_overrides, config.convert)
    if scoring.scores and not config.pooling:
        raise ValueError(f"{config.model} is a sequence classification model: serve it with "
                         "--runner pooling (/score, /rerank, /classify)")
    if config.backend == "torch" and is_gguf(config.model):
        check_gguf(config.model)


def _log_generation_defaults(config: EngineConfig):
    """Say which sampling defaults requests get, and from where (as vLLM does); returns them."""
    from pipellm.shared.generation_config import GenerationDefaults

    defaults = GenerationDefaults.of(config)
    logging.getLogger("pipellm").info(defaults.describe())
    return defaults


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServiceConfig]:
    """Both configs; --max-pending left unset follows the running batch the engine got."""
    engine = _engine_config(args)
    derived = {}
    if "max_pending" in unset_by_device(ServiceConfig, args):
        derived["max_pending"] = ServiceConfig.pending_by_device(engine.scheduler.max_running,
                                                                 args.data_parallel_size)
    return engine, config_from_args(ServiceConfig, args, **derived)


def _service(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"pipellm.services.{args.service}.service")
    module.serve(*_configs(args))
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    from pipellm.services.compute.backend import build_engine
    from pipellm.services.gateway.chat_settings import ChatSettings
    from pipellm.services.run_batch import run_batch
    from pipellm.services.tokenizer.service import Tokenizer
    from pipellm.shared.heap import settle_heap
    from pipellm.shared.model_config import served_name

    config = _engine_config(args)
    with open(args.input_file, encoding="utf-8") as src:  # before loading: a typo fails fast
        lines = src.readlines()
    defaults = _log_generation_defaults(config)
    svc = config_from_args(ServiceConfig, args)  # the chat flags (checked)
    engine, tokenizer = build_engine(config), Tokenizer(config)
    settle_heap(svc.gc_young_threshold)
    name = args.served_model_name or served_name(config.model)
    with open(args.output_file, "w", encoding="utf-8") as dst:
        n, failed, tokens, seconds = run_batch(
            engine, tokenizer, name, lines, dst, defaults=defaults,
            chat=ChatSettings.of(svc, tokenizer.template),
            max_text_bytes=svc.prompt_bytes_limit(tokenizer.max_model_len))
    print(f"run-batch: {n} requests ({failed} failed), {tokens} output tokens in "
          f"{seconds:.1f} s: {tokens / max(seconds, 1e-9):.1f} tok/s")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.sampling import SamplingParams
    from pipellm.shared.tokenizer import decode, encode, load_tokenizer

    config = _engine_config(args)
    engine = build_engine(config)
    tok = load_tokenizer(config.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    seqs = engine.generate([encode(tok, p) for p in args.prompt], params)
    for prompt, seq in zip(args.prompt, seqs, strict=True):
        text = decode(tok, seq.output_ids)
        if args.json:
            print(json.dumps({"prompt": prompt, "token_ids": seq.output_ids, "text": text,
                              "finish_reason": seq.finish_reason}, ensure_ascii=False))
        else:
            print(f"{prompt!r} -> {text!r} ({seq.finish_reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
