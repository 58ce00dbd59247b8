"""The integration examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_minimal_target_example() -> None:
    assert "mean acceptance length" in run("minimal_target.py")


def test_minimal_target_is_the_documented_one() -> None:
    doc = (ROOT / "docs" / "integrating-a-target.md").read_text()
    assert (ROOT / "examples" / "minimal_target.py").read_text() in doc


def test_hf_generate_example() -> None:
    pytest.importorskip("torch")
    assert "identical to model.generate" in run("hf_generate.py", "--new-tokens", "16")
