"""Workload loading: synthetic lengths, and the ShareGPT reader on a tiny file."""

from __future__ import annotations

import json
from pathlib import Path

from pipellm.loadgen.datasets import (
    CHARS_PER_TOKEN,
    SHAREGPT_FILE,
    WorkItem,
    default_data_dir,
    load_sharegpt,
    synthetic,
)
from pipellm.loadgen.prefix_datasets import multiturn_items, shared_prefix_items
from tests.hf_models import demo_tokenizer


def _write(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def _conv(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": r, "value": v} for r, v in turns]}


def test_synthetic_is_deterministic_and_positive():
    a = synthetic(200, seed=3, mean_prompt=100, mean_output=50)
    assert a == synthetic(200, seed=3, mean_prompt=100, mean_output=50)
    assert a != synthetic(200, seed=4, mean_prompt=100, mean_output=50)
    assert all(w.prompt is None and w.prompt_len >= 1 and w.output_len >= 1 for w in a)
    mean_p = sum(w.prompt_len for w in a) / len(a)
    mean_o = sum(w.output_len for w in a) / len(a)
    assert 70 < mean_p < 130 and 35 < mean_o < 65
    assert len({w.prompt_len for w in a}) > 20  # lengths vary


def test_load_sharegpt_estimates_without_tokenizer(tmp_path: Path):
    path = _write(tmp_path / "s.json", [
        _conv(("human", "a" * 40), ("gpt", "b" * 100), ("human", "ignored"), ("gpt", "ignored")),
        _conv(("gpt", "no prompt first"), ("human", "q" * 8), ("gpt", "")),
        _conv(("human", "only a question")),
        {"id": "empty", "conversations": []},
        _conv(("human", ""), ("gpt", "empty prompt")),
    ])
    items = load_sharegpt(path)
    assert items == [WorkItem("a" * 40, 10, 25), WorkItem("q" * 8, 2, 1)]


def test_load_sharegpt_with_tokenizer_and_limit(tmp_path: Path):
    tok = demo_tokenizer()
    q, a = "What time is it?", "It was going to be a quiet morning."
    path = _write(tmp_path / "s.json", [_conv(("human", q), ("gpt", a))] * 3)
    items = load_sharegpt(path, tokenizer=tok, limit=2)
    assert len(items) == 2
    assert items[0].prompt == q
    assert items[0].prompt_len == len(tok.encode(q).ids)  # with BOS
    assert items[0].output_len == len(tok.encode(a, add_special_tokens=False).ids)


def test_default_data_dir_is_in_the_repo():
    repo = Path(__file__).resolve().parents[1]
    assert default_data_dir() == repo / "data"


def test_multiturn_prompts_extend_the_previous_turn():
    path = default_data_dir() / SHAREGPT_FILE
    items = multiturn_items(path, 10, seed=3, turns=4)
    chats = 3  # ceil(10 / 4), turn by turn across them
    assert len(items) == 10
    for k in range(1, 3):
        for c in range(chats):
            if k * chats + c < 10:
                prev, cur = items[(k - 1) * chats + c], items[k * chats + c]
                assert cur.prompt.startswith(prev.prompt) and cur.prompt_len > prev.prompt_len
    assert items[0].prompt.startswith("User: ") and items[0].prompt.endswith("\nAssistant:")
    assert multiturn_items(path, 10, seed=3, turns=4) == items
    assert all(w.prompt_len <= 4 * 165 + 3 * 165 and w.output_len <= 165 for w in items)


def test_shared_prefix_prompts_share_a_system_text_of_the_asked_length():
    path = default_data_dir() / SHAREGPT_FILE
    items = shared_prefix_items(path, 6, system_tokens=1000)
    system = items[0].prompt.split("\n\nUser: ")[0]
    assert 950 <= len(system) / CHARS_PER_TOKEN <= 1000
    assert all(w.prompt.startswith(system + "\n\nUser: ") for w in items)
    assert len({w.prompt for w in items}) == 6
