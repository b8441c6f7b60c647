"""The `pipellm` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from shared.config import EngineConfig, ServiceConfig, add_config_args, config_from_args


def main(argv: list[str] | None = None) -> int:
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
    serve = sub.add_parser("serve", help="run one service (what each container runs)")
    serve.add_argument("service", choices=SERVICES)
    up = sub.add_parser("up", help="start Redis and all four services, supervised")
    for p in (serve, up):
        add_config_args(p, EngineConfig)
        add_config_args(p, ServiceConfig)
    from services.compute.sim import roofline

    roof = sub.add_parser("roofline", help="decode roofline of a model on a GPU (sim backend)",
                          description=roofline.__doc__)
    roofline.add_args(roof)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command != "generate" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from shared.model_config import ModelLoadError
    from shared.tokenizer import TokenizerLoadError

    try:
        if args.command == "roofline":
            return roofline.run(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "up":
            from services.supervisor import up

            engine, svc = _configs(args)
            _check_model(engine)
            return up(engine, svc)
        return _generate(args)
    except (ModelLoadError, TokenizerLoadError, ValueError, OSError) as e:
        print(f"pipellm: error: {e}", file=sys.stderr)
        return 2


SERVICES = ("gateway", "tokenizer", "compute", "detokenizer")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags; no --model means the default model (SmolLM2, else demo)."""
    from shared import default_model

    config = config_from_args(EngineConfig, args, model=args.model or default_model.resolve())
    from services.compute.scheduling.scheduler import SchedulerConfig

    SchedulerConfig.of(config)  # a bad combination of scheduler flags fails here, not in compute
    if config.backend == "sim":  # a bad --sim-* value fails here, not in a restarting child
        from services.compute.sim import check_config

        check_config(config)
    from services.compute.backend import resolve

    return resolve(config)  # raises ModelLoadError for a model that cannot be read


def _check_model(config: EngineConfig) -> None:
    """Raise (ModelLoadError, TokenizerLoadError, ValueError) if the model cannot be served,
    before any service starts: its config, tokenizer, chat template and tensor table."""
    from services.compute.model.gguf_weights import check_gguf
    from shared.chat_template import load_chat_template
    from shared.gguf.reader import is_gguf
    from shared.tokenizer import load_tokenizer

    load_tokenizer(config.model)
    load_chat_template(config.model)
    if config.backend == "torch" and is_gguf(config.model):
        check_gguf(config.model)


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServiceConfig]:
    return _engine_config(args), config_from_args(ServiceConfig, args)


def _serve(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"services.{args.service}.service")
    module.serve(*_configs(args))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from services.compute.backend import build_engine
    from shared.sampling import SamplingParams
    from shared.tokenizer import decode, encode, load_tokenizer

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
