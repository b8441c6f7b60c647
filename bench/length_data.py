"""SmolLM2-135M-Instruct's own output lengths on the 1024 ShareGPT samples: the lengths the
hidden-state length predictor is judged on (bench/length_predictor.py).

Each sample's first question goes through the model's chat template and the engine
in-process (the default model and settings, --quantization auto), twice: greedy, and sampled at
temperature 0.7 with seed 1000 + the sample's index; max_tokens 1024. Written:

- bench/data/smollm2_lengths.jsonl (committed): a first line with the command, model and
  settings, then per (setting, sample) `index`, `setting`, `prompt_tokens`, `output_tokens`,
  `finish_reason`; no texts;
- the output token ids, under --cache (not committed: the length bench replays them through
  the model to get the hidden states the server would have seen while generating).

    python -m bench.length_data                 # ~1 h on 2 cores
    python -m bench.length_data --limit 16      # a smoke run (to --out elsewhere)

The last line is JSON: per setting, requests, output tokens, mean length, share that hit the
limit, tok/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs
from services.compute.backend import build_engine
from shared import default_model
from shared.chat_template import load_chat_template
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.tokenizer import encode, load_tokenizer

DATA = Path(__file__).resolve().parent / "data" / "smollm2_lengths.jsonl"
CACHE = Path("~/.cache/pipellm/length_data").expanduser()
MAX_TOKENS = 1024
SETTINGS = {"greedy": dict(temperature=0.0), "t0.7": dict(temperature=0.7)}
SEED_BASE = 1000


def chat_prompts(model: str, limit: int | None) -> list[list[int]]:
    """The samples' first questions in the model's chat template, as token ids."""
    tok, template = load_tokenizer(model), load_chat_template(model)
    pairs = sharegpt_pairs(default_data_dir() / SHAREGPT_FILE, limit)
    return [encode(tok, template.render([{"role": "user", "content": q}], True),
                   add_special_tokens=False) for q, _ in pairs]


def params(setting: str, index: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, seed=SEED_BASE + index, **SETTINGS[setting])


def load(path: Path = DATA) -> tuple[dict, dict[str, list[dict]]]:
    """(header, setting -> rows in index order) of a lengths file."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows: dict[str, list[dict]] = {}
    for r in lines[1:]:
        rows.setdefault(r["setting"], []).append(r)
    return lines[0], {s: sorted(v, key=lambda r: r["index"]) for s, v in rows.items()}


def output_ids(setting: str, cache: Path = CACHE) -> list[list[int]] | None:
    """The cached output token ids of a setting (index order), or None if not generated here."""
    path = cache / f"{setting}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=None, help="first N samples only")
    p.add_argument("--out", type=Path, default=DATA, help="the lengths file")
    p.add_argument("--cache", type=Path, default=CACHE, help="where output ids go")
    p.add_argument("--max-running", type=int, default=128, help="engine batch")
    args = p.parse_args(argv)
    model = default_model.resolve()
    prompts = chat_prompts(model, args.limit)
    engine = build_engine(EngineConfig(model=model, max_running=args.max_running, kv_cache_gib=4.0))
    header = {"command": "python -m bench.length_data" + "".join(f" {a}" for a in sys.argv[1:]),
              "model": Path(model).name, "max_tokens": MAX_TOKENS, "seed": f"{SEED_BASE} + index",
              "settings": SETTINGS, "engine": engine.runner.summary.get("dtype")}
    rows, summary = [], {}
    args.cache.mkdir(parents=True, exist_ok=True)
    for setting in SETTINGS:
        start = time.perf_counter()
        seqs = engine.generate(prompts, [params(setting, i) for i in range(len(prompts))])
        seconds = time.perf_counter() - start
        lens = [s.num_output for s in seqs]
        rows += [{"index": i, "setting": setting, "prompt_tokens": len(prompts[i]),
                  "output_tokens": s.num_output, "finish_reason": s.finish_reason}
                 for i, s in enumerate(seqs)]
        (args.cache / f"{setting}.json").write_text(json.dumps([s.output_ids for s in seqs]))
        summary[setting] = {"requests": len(seqs), "output_tokens": sum(lens),
                            "mean": round(sum(lens) / len(lens), 1),
                            "at_limit": round(sum(n >= MAX_TOKENS for n in lens) / len(lens), 3),
                            "tok_s": round(sum(lens) / seconds, 1)}
        print(f"{setting}: {summary[setting]}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
