"""EleutherAI's lm-eval, unchanged, against `pipellm serve` on the default model (SmolLM2): its
`local-completions` model with batch_size 4 and the server's own tokenizer (lm-eval's "remote"
backend: our /tokenize and /detokenize), on a loglikelihood task (multiple choice: batched
token-id prompts, echo, logprobs, max_tokens 0) and a generate_until task (batched prompts,
stop strings), both defined in YAML over local JSON (no dataset hub here). The scores must be
the ones the same requests get one at a time (batch_size 1): the same texts and accuracy,
loglikelihoods within 5% (a step's row count picks the CPU GEMM's kernel). The
comparison with vLLM's CPU build is bench/lm_eval_peers.py's."""

from __future__ import annotations

import json
import os

import pytest

from pipellm.shared import default_model
from tests.stack import Stack

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON only: never ask the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

MODEL = "smol"
CAPITALS = [("France", "Paris", ["Lyon", "Nice"]), ("Japan", "Tokyo", ["Osaka", "Kyoto"]),
            ("Italy", "Rome", ["Milan", "Turin"]), ("Spain", "Madrid", ["Seville", "Bilbao"]),
            ("Germany", "Berlin", ["Hamburg", "Munich"]), ("Egypt", "Cairo", ["Giza", "Luxor"]),
            ("Canada", "Ottawa", ["Toronto", "Calgary"]), ("Kenya", "Nairobi", ["Mombasa",
                                                                                "Kisumu"])]
SUMS = [(2, 3), (10, 5), (7, 1), (4, 4), (12, 8), (9, 9)]


def _tasks(root) -> str:
    """Two lm-eval tasks over local JSON files, as YAML in `root`; returns the folder."""
    docs = [{"country": c, "choices": [right, *wrong], "gold": 0} for c, right, wrong in CAPITALS]
    (root / "capitals.json").write_text(json.dumps(docs))
    (root / "sums.json").write_text(json.dumps([{"q": f"{a} + {b} =", "a": str(a + b)}
                                                for a, b in SUMS]))
    (root / "capitals.yaml").write_text(f"""task: pipellm_capitals
dataset_path: json
dataset_kwargs:
  data_files: {root / 'capitals.json'}
test_split: train
output_type: multiple_choice
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (root / "sums.yaml").write_text(f"""task: pipellm_sums
dataset_path: json
dataset_kwargs:
  data_files: {root / 'sums.json'}
test_split: train
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return str(root)


@pytest.fixture(scope="module")
def server():
    s = Stack(default_model.fetch(), "--kv-cache-tokens", "8192", "--served-model-name", MODEL,
              "--generation-config", "vllm")
    s.start(timeout_s=300)
    yield s
    s.stop()


def _evaluate(server, tasks: str, batch_size: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = (f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
            f"num_concurrent=1,max_retries=1,tokenized_requests=True")
    out = simple_evaluate(model="local-completions", model_args=args,
                          tasks=["pipellm_capitals", "pipellm_sums"], batch_size=batch_size,
                          task_manager=TaskManager(include_path=tasks, include_defaults=False),
                          log_samples=True)
    scores = {task: {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
              for task, metrics in out["results"].items()}
    return scores, {task: [s["resps"] for s in samples]
                    for task, samples in out["samples"].items()}


def test_lm_eval_scores_are_the_same_batched_and_one_at_a_time(server, tmp_path):
    tasks = _tasks(tmp_path)
    batched, batched_resps = _evaluate(server, tasks, 4)
    single, single_resps = _evaluate(server, tasks, 1)
    assert batched == single
    assert batched_resps["pipellm_sums"] == single_resps["pipellm_sums"]  # the texts
    for b, s in zip(batched_resps["pipellm_capitals"], single_resps["pipellm_capitals"],
                    strict=True):  # each choice's (loglikelihood, is_greedy): the rows a step
        # holds pick the CPU GEMM (INT8 below --amx-rows, bf16 from it), so within 5%
        assert [r[0][1] for r in b] == [r[0][1] for r in s]
        assert [r[0][0] for r in b] == pytest.approx([r[0][0] for r in s], rel=0.05, abs=0.02)
    assert batched["pipellm_capitals"]["acc,none"] >= 5 / 8, batched  # SmolLM2 knows them
    assert 0 <= batched["pipellm_sums"]["exact_match,number"] <= 1
