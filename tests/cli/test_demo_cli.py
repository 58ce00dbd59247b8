"""`exstill demo`: the shipped demo pair, speculative against the target alone, on the built-in
emulator and on a card across TCP."""

from __future__ import annotations

import json
import subprocess

from exstill_sdk.demo import DEFAULT_PROMPT, demo_dir, demo_tokenizer

from .helpers import script, start_emu


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script("exstill"), "demo", *args], capture_output=True, text=True, timeout=300
    )


def test_demo_on_the_builtin_emulator_matches_the_target_alone() -> None:
    out = demo("--max-new-tokens", "48", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["identical"] is True and result["new_tokens"] == 48
    tokenizer = demo_tokenizer()
    prompt_ids = tokenizer.encode(DEFAULT_PROMPT).ids
    assert tokenizer.encode(DEFAULT_PROMPT + result["text"]).ids[: len(prompt_ids)] == prompt_ids
    assert len(result["acceptance_per_position"]) == 8
    assert result["acceptance_per_position"] == sorted(result["acceptance_per_position"])[::-1]
    assert result["mean_acceptance_length"] > 1.5  # the draft was distilled from this target
    assert sum(result["k_chosen"].values()) == result["rounds"]


def test_demo_streams_text_then_figures() -> None:
    out = demo("--max-new-tokens", "24", "--k", "4", "--prompt", "import os\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os\n")
    assert "identical output: yes (24 tokens)" in out.stdout
    chosen = out.stdout.splitlines()[-1]  # the last round may be shortened by the budget
    assert chosen.startswith("K chosen") and "K=4:" in chosen and "K=5" not in chosen


def test_demo_against_a_card_over_tcp() -> None:
    proc, url = start_emu("--context", "2048")  # no demo draft on this card
    try:
        out = demo("--url", url, "--max-new-tokens", "8")
        assert out.returncode == 2 and "exstill-flash" in out.stderr
    finally:
        proc.terminate()
        proc.wait(10)
    proc, url = start_emu("--context", "2048", "--image", str(demo_dir() / "draft.img"))
    try:
        out = demo("--url", url, "--max-new-tokens", "32", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["identical"] is True
    finally:
        proc.terminate()
        proc.wait(10)
