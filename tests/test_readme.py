"""README.md stays a front page: about 70 lines, the two set-up commands, and links that lead
somewhere (the files exist, and a #fragment names a heading of its file)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_is_short_with_the_two_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 72
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    assert "bash scripts/setup.sh && .venv/bin/pipellm serve\nbash tests/run.sh\n" in blocks


def test_readme_links_lead_somewhere():
    links = re.findall(r"\]\(([^)]+)\)", README.read_text())
    assert links
    for link in links:
        path, _, fragment = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if fragment:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert fragment in {_anchor(h) for h in headings}, link
