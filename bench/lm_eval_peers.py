"""lm-eval scores of pipellm against vLLM's CPU build, same model (SmolLM2-135M-Instruct), same
harness, same requests: EleutherAI's lm-eval, unchanged, through its `local-completions` model
(batch size 8, the model's HF tokenizer), on two tasks defined here over local JSON (no dataset
hub): a loglikelihood task (which of 3 cities is a country's capital) and a generate_until task
(the capital, greedy, exact match). Servers (bench/vs_peers.py's names): pipellm (its default:
the GGUF's INT4 blocks), pipellm-fp32 and vllm-fp32 (the GGUF expanded to float32), one at a
time. The target (issue 47): pipellm's scores equal vLLM's within the harness's stderr.

    python -m bench.lm_eval_peers [--servers pipellm,pipellm-fp32,vllm-fp32]

The last line printed is one JSON object: each server's scores, pipellm's differences from
vLLM's (within the stderr or not), and the mean |loglikelihood gap| per answer choice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import servers, vs_peers  # noqa: E402
from bench.common import isa, log, machine  # noqa: E402

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid",
    "Germany": "Berlin", "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi",
    "Russia": "Moscow", "China": "Beijing", "India": "Delhi", "Brazil": "Brasilia",
    "Mexico": "Mexico City", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
    "Greece": "Athens", "Portugal": "Lisbon", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin",
    "Hungary": "Budapest", "Turkey": "Ankara", "Iran": "Tehran", "Iraq": "Baghdad",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Cuba": "Havana", "Australia": "Canberra",
    "Belgium": "Brussels", "Denmark": "Copenhagen", "Netherlands": "Amsterdam",
    "Switzerland": "Bern", "Nigeria": "Abuja", "Morocco": "Rabat", "Colombia": "Bogota",
    "South Korea": "Seoul",
}


def tasks(root: Path) -> str:
    names = list(CAPITALS)
    docs = []
    for i, country in enumerate(names):
        wrong = [CAPITALS[names[(i + k) % len(names)]] for k in (7, 13)]
        docs.append({"country": country, "choices": [CAPITALS[country], *wrong], "gold": 0,
                     "answer": CAPITALS[country]})
    (root / "capitals.json").write_text(json.dumps(docs))
    common = f"""dataset_path: json
dataset_kwargs:
  data_files: {root / 'capitals.json'}
test_split: train
"""
    (root / "mc.yaml").write_text(f"""task: peers_capitals_mc
{common}output_type: multiple_choice
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (root / "gen.yaml").write_text(f"""task: peers_capitals_gen
{common}output_type: generate_until
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA: The capital of {{{{country}}}} is"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", ".", ","]
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "([A-Z][A-Za-z ]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
""")
    return str(root)


def evaluate(url: str, tokenizer: Path, task_dir: str, batch_size: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = (f"model=smol,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer},num_concurrent=1,max_retries=2,tokenized_requests=True")
    out = simple_evaluate(model="local-completions", model_args=args,
                          tasks=["peers_capitals_mc", "peers_capitals_gen"],
                          batch_size=batch_size,
                          task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                          log_samples=True)
    scores = {task: {k: round(float(v), 4) for k, v in m.items()
                     if isinstance(v, int | float) and "," in k}
              for task, m in out["results"].items()}
    lls = [r[0][0] for s in out["samples"]["peers_capitals_mc"] for r in s["resps"]]
    return {"scores": scores, "loglikelihoods": lls}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="pipellm,pipellm-fp32,vllm-fp32")
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args(argv)
    args = vs_peers.parse_args(["--servers", a.servers, "--rounds", "1"])
    args.vllm_extra += " --served-model-name smol"
    args.pipellm_extra += " --served-model-name smol --generation-config vllm"
    vs_peers.prepare(args)
    log(f"machine: {machine()}; ISA {isa()}")
    task_dir = tasks(Path(tempfile.mkdtemp(prefix="lm-eval-")))
    scores = {}
    for name in args.servers:
        port = servers.free_port()
        server = vs_peers.make_server(args, name, port, args.results_dir / f"{name}.log")
        try:
            with servers.running(server, args.ready_timeout) as startup_s:
                log(f"{name} ready after {startup_s:.0f} s")
                scores[name] = evaluate(f"http://127.0.0.1:{port}", args.hf_dir, task_dir,
                                        a.batch_size)
                log(f"{name}: {scores[name]}")
        except servers.ServerError as exc:
            log(f"{name}: {exc}")
    base = scores.get("vllm-fp32")
    gaps, ll_gaps = {}, {}
    for name, res in scores.items():
        if name == "vllm-fp32" or base is None:
            continue
        for task, m in res["scores"].items():
            for metric in (k for k in m if "_stderr," not in k):
                err = m.get(metric.replace(",", "_stderr,")) or 0.0
                diff = m[metric] - base["scores"][task][metric]
                gaps[f"{name}/{task}/{metric}"] = dict(diff=round(diff, 4), stderr=err,
                                                       within=abs(diff) <= err)
        pairs = list(zip(res["loglikelihoods"], base["loglikelihoods"], strict=True))
        ll_gaps[name] = round(sum(abs(a - b) for a, b in pairs) / len(pairs), 7)
    for key, gap in gaps.items():
        log(f"{key}: {gap['diff']:+.4f} from vllm-fp32 (stderr {gap['stderr']}: "
            f"{'within' if gap['within'] else 'beyond'})")
    for name, gap in ll_gaps.items():
        log(f"{name}: mean |loglikelihood - vllm-fp32's| {gap} per choice")
    result = dict(machine=machine(), isa=isa(),
                  scores={n: r["scores"] for n, r in scores.items()}, gaps=gaps,
                  mean_abs_loglikelihood_gap=ll_gaps)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
