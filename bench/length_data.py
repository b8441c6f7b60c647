"""SmolLM2-135M-Instruct's own output lengths on the 1024 ShareGPT samples, with the hidden
states the server saw while generating them: the data the hidden-state length predictor is
judged on (bench/length_predictor.py --lengths smollm2).

Each sample's first question goes through the model's chat template and the engine
in-process (the default model and settings, --quantization auto), twice: greedy, and sampled at
temperature 0.7 with seed 1000 + the sample's index; max_tokens 1024. The engine's length hook
is a recorder: at every checkpoint (the last prompt token, then every 32 generated tokens) it
keeps the full final-normed hidden state (the probe is the identity), so no second pass over
the texts is needed. The work goes in chunks of 128 samples, both settings per chunk, each
saved as it completes: a rerun resumes after the last complete chunk. Written:

- bench/data/smollm2_lengths.jsonl (committed): a first line with the command, model,
  settings and how many samples are complete, then per (setting, sample) `index`, `setting`,
  `prompt_tokens`, `output_tokens`, `finish_reason`; no texts;
- under --cache (not committed): per chunk and setting, the output ids and the hidden states.

    python -m bench.length_data                 # 6-8 min a chunk (both settings) on 2 cores
    python -m bench.length_data --chunks 2      # the first 256 samples only

The last line is JSON: per setting, samples done, output tokens, mean length, share that hit
the limit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs
from pipellm.services.compute.backend import build_engine
from pipellm.shared import default_model
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import encode, load_tokenizer

DATA = Path(__file__).resolve().parent / "data" / "smollm2_lengths.jsonl"
CACHE = Path("~/.cache/pipellm/length_data").expanduser()
MAX_TOKENS = 1024
SETTINGS = {"greedy": dict(temperature=0.0), "t0.7": dict(temperature=0.7)}
SEED_BASE = 1000
NUM_SAMPLES, CHUNK, EVERY = 1024, 128, 32


def chat_prompts(model: str, limit: int | None) -> list[list[int]]:
    """The samples' first questions in the model's chat template, as token ids."""
    tok, template = load_tokenizer(model), load_chat_template(model)
    pairs = sharegpt_pairs(default_data_dir() / SHAREGPT_FILE, limit)
    return [encode(tok, template.render([{"role": "user", "content": q}], True),
                   add_special_tokens=False) for q, _ in pairs]


def sample_params(setting: str, index: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, seed=SEED_BASE + index, **SETTINGS[setting])


def load(path: Path = DATA) -> tuple[dict, dict[str, list[dict]]]:
    """(header, setting -> rows in index order) of a lengths file."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows: dict[str, list[dict]] = {}
    for r in lines[1:]:
        rows.setdefault(r["setting"], []).append(r)
    return lines[0], {s: sorted(v, key=lambda r: r["index"]) for s, v in rows.items()}


class Recorder:
    """The engine's length hook (LengthRefiner's interface), recording instead of predicting:
    request id -> [(generated, hidden state)] at every checkpoint."""

    def __init__(self):
        self.points = {}

    def observe(self, checkpoints) -> None:
        for seq, generated, probe in checkpoints:
            self.points.setdefault(seq.request_id, []).append((generated, probe.copy()))

    def finished(self, seq) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def tick(self) -> None: ...


def recording_engine(model: str, max_running: int):
    """The default engine with a Recorder as its length hook and an identity probe (the
    runner probes every EVERY generated tokens)."""
    hidden = ModelConfig.from_path(model).hidden_size
    engine = build_engine(EngineConfig(model=model,
                                       scheduler=SchedulerConfig(max_running=max_running),
                                       kv_cache_gib=4.0, hidden_length=True,
                                       length_probe_dim=hidden, length_refine_every=EVERY))
    engine.lengths = Recorder()
    return engine


def run_chunk(engine, prompts: list[list[int]], first: int, setting: str, path: Path) -> None:
    """Generate samples first.. (len(prompts)) in `setting`; save ids, rows, hidden states."""
    engine.lengths.points.clear()
    params = [sample_params(setting, first + i) for i in range(len(prompts))]
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    seqs = [engine.requests[r] for r in rids]
    while engine.has_work():
        engine.step()
    rows, hidden, offsets = [], [], [0]
    for i, (rid, s) in enumerate(zip(rids, seqs, strict=True)):
        points = sorted(engine.lengths.points.pop(rid, []), key=lambda p: p[0])
        hidden += [h.astype(np.float16) for _, h in points]
        offsets.append(offsets[-1] + len(points))
        rows.append({"index": first + i, "setting": setting, "prompt_tokens": len(prompts[i]),
                     "output_tokens": s.num_output, "finish_reason": s.finish_reason})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, hidden=np.stack(hidden), offsets=np.array(offsets),
             rows=np.array(json.dumps(rows)),
             ids=np.array(json.dumps([s.output_ids for s in seqs])))
    tmp.rename(path)


def chunk_path(cache: Path, setting: str, chunk: int) -> Path:
    return cache / setting / f"chunk{chunk:03d}.npz"


def read_chunks(setting: str, cache: Path = CACHE) -> list[dict]:
    """The complete chunks of a setting in order, each {rows, ids, hidden, offsets}."""
    out = []
    for c in range(NUM_SAMPLES // CHUNK):
        path = chunk_path(cache, setting, c)
        if not path.is_file():
            break
        with np.load(path) as z:
            out.append({"rows": json.loads(str(z["rows"])), "ids": json.loads(str(z["ids"])),
                        "hidden": z["hidden"], "offsets": z["offsets"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=NUM_SAMPLES // CHUNK,
                   help=f"chunks of {CHUNK} samples to have done")
    p.add_argument("--out", type=Path, default=DATA, help="the lengths file")
    p.add_argument("--cache", type=Path, default=CACHE, help="where ids and hidden states go")
    p.add_argument("--max-running", type=int, default=CHUNK, help="engine batch")
    args = p.parse_args(argv)
    model = default_model.resolve()
    prompts = chat_prompts(model, NUM_SAMPLES)
    engine = None
    for c in range(args.chunks):
        for setting in SETTINGS:
            path = chunk_path(args.cache, setting, c)
            if path.is_file():
                continue
            engine = engine or recording_engine(model, args.max_running)
            start = time.perf_counter()
            run_chunk(engine, prompts[c * CHUNK : (c + 1) * CHUNK], c * CHUNK, setting, path)
            print(f"chunk {c} {setting}: {time.perf_counter() - start:.0f} s", flush=True)
    summary = write_lengths(args.out, model, args.cache)
    print(json.dumps(summary))
    return 0


def write_lengths(out: Path, model: str, cache: Path) -> dict:
    """The lengths file from the chunks complete in both settings."""
    chunks = {s: read_chunks(s, cache) for s in SETTINGS}
    done = min(len(c) for c in chunks.values())
    rows = [r for s in SETTINGS for c in chunks[s][:done] for r in c["rows"]]
    header = {"command": "python -m bench.length_data", "model": Path(model).name,
              "max_tokens": MAX_TOKENS, "seed": f"{SEED_BASE} + index", "settings": SETTINGS,
              "samples": done * CHUNK, "of": NUM_SAMPLES}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    summary = {}
    for s in SETTINGS:
        lens = [r["output_tokens"] for r in rows if r["setting"] == s]
        summary[s] = {"samples": len(lens), "output_tokens": sum(lens),
                      "mean": round(sum(lens) / max(len(lens), 1), 1),
                      "at_limit": round(sum(n >= MAX_TOKENS for n in lens) / max(len(lens), 1),
                                        3)}
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
