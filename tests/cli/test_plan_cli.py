"""exstill plan: the table for a shipped deployment, fixed K, plots, and bad profiles refused in
one line that names the field."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .helpers import script


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script("exstill"), "plan", *args], capture_output=True, text=True, timeout=120
    )


def test_gpt_oss_table_with_a_shape_per_row() -> None:
    out = _plan("--target", "gpt-oss-120b", "--acceptance", "seed-qwen3-next", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    rows = result["rows"]
    assert [r["users"] for r in rows] == [1, 2, 4, 8, 16]
    chains = {f"chain of {k}" for k in range(1, 17)} | {"no draft"}
    trees = {f"tree of {n}" for n in (4, 8, 12, 16, 24, 32, 48, 64)}
    for r in rows:
        assert r["speedup"] > 1 and r["plain_tokens_per_s"] > 0
        by_shape = r["tokens_per_s_by_shape"]
        assert r["tokens_per_s"] == max(by_shape.values()) and set(by_shape) == chains | trees
        assert r["shape"] in by_shape and 1 <= r["outcomes_ahead"] <= 16
        assert r["tokens_per_s_per_user"] * r["users"] == pytest.approx(r["tokens_per_s"], rel=0.01)
    assert rows[0]["plain_tokens_per_s"] == 526.0  # the seed's published speed, the anchor
    assert rows[-1]["waves"] == 2  # sixteen users on twelve streams: two waves
    text = _plan("--target", "gpt-oss-120b", "--acceptance", "seed-qwen3-next")
    assert text.returncode == 0 and "gpt-oss-120b" in text.stdout
    assert len(text.stdout.strip().splitlines()) == 2 + 5


def test_fixed_k_cards_and_plot(tmp_path: Path) -> None:
    out = _plan(
        "--target", "gpt-oss-120b", "--acceptance", "seed-qwen3-next", "--users", "16",
        "--k", "3", "--cards", "2", "--plot", str(tmp_path), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert (row["k"], row["waves"]) == (3, 1)
    assert (tmp_path / "plan_speedup.png").stat().st_size > 1000


def test_a_fixed_tree(tmp_path: Path) -> None:
    out = _plan(
        "--target", "kimi-k3", "--acceptance", "seed-qwen3-next", "--users", "1,16",
        "--tree", "12", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["shape"] == "tree of 12"
    assert [r["shape"] for r in result["rows"]] == ["tree of 12"] * 2
    run = tmp_path / "vllm.json"  # a run's counters hold no ranks: no tree can be planned
    run.write_text(json.dumps({"num_drafts": 10, "num_accepted_tokens_per_pos": [9, 8, 7, 6]}))
    out = _plan("--target", "kimi-k3", "--acceptance", str(run), "--tree", "12")
    assert out.returncode == 2 and "top_k or tree_mean_length" in out.stderr


def test_seed_comparison_from_a_scenario(tmp_path: Path) -> None:
    """--seed with a scenario of two of the seed's points: the planner's figure beside the
    seed's, the difference, and for a point outside the tolerance what would close it."""
    shipped = Path(__file__).resolve().parents[2] / "exstill_sdk" / "data" / "scenarios"
    text = (shipped / "seed.toml").read_text()
    head, *points = text.split("[[point]]")
    kimi = [p for p in points if '"kimi-k3"' in p and "users = 1\n" in p]
    qwen = [p for p in points if '"qwen3-next-80b"' in p]
    scenario = tmp_path / "s.toml"
    scenario.write_text(head + "".join(f"[[point]]{p}" for p in kimi + qwen))
    out = _plan("--seed", str(scenario), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    first, second = result["points"]
    assert (first["target"], first["users"], first["seed"], first["unit"]) == (
        "kimi-k3",
        1,
        3.6,
        "x",
    )
    for p in (first, second):
        assert p["difference"] == pytest.approx(p["planner"] / p["seed"] - 1, abs=1e-3)
        assert p["within"] == (abs(p["difference"]) <= 0.10)
        assert p["within"] or p["gap"]  # outside the tolerance: what would close the gap
    assert second["planner_plain_tokens_per_s"] == 275.0
    text = _plan("--seed", str(scenario))
    assert text.returncode == 0 and "qwen3-next-80b" in text.stdout and "within 10%" in text.stdout


def test_acceptance_from_a_run_json(tmp_path: Path) -> None:
    run = tmp_path / "vllm.json"
    run.write_text(json.dumps({"num_drafts": 10, "num_accepted_tokens_per_pos": [9, 8, 7, 6]}))
    out = _plan("--target", "qwen3-next-80b", "--acceptance", str(run), "--users", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["acceptance"]["per_position"][:4] == [0.9, 0.8, 0.7, 0.6]


def test_bad_profile_is_one_line_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text('[target]\nname = "x"\n[target.pass]\ntokens = [1, 2]\nms = [5.0, -1.0]\n')
    out = _plan("--target", str(bad), "--acceptance", "seed-qwen3-next")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "target.pass.ms[1]" in out.stderr
    assert "Traceback" not in out.stderr
    acc = tmp_path / "a.toml"
    acc.write_text("[acceptance]\nper_position = [0.9, 1.5]\n")
    out = _plan("--target", "gpt-oss-120b", "--acceptance", str(acc), "--json")
    assert out.returncode == 2
    assert "acceptance.per_position[1]" in json.loads(out.stdout)["error"]


def test_usage_mistakes() -> None:
    for args, words in (
        (("--users", "1,x"), "--users"),
        (("--k", "17"), "--k wants auto or 0..16"),
        (("--tree", "65"), "--tree wants 1..64 nodes"),
        (("--cards", "0"), "--cards"),
    ):
        out = _plan("--target", "gpt-oss-120b", "--acceptance", "seed-qwen3-next", *args)
        assert out.returncode == 2 and words in out.stderr, out.stderr
    out = _plan("--target", "no-such", "--acceptance", "seed-qwen3-next")
    assert out.returncode == 2 and "shipped ones" in out.stderr


def test_a_profile_file_without_a_suffix_that_is_not_toml_says_so(tmp_path: Path) -> None:
    """A file without .toml or .json is read as TOML, and the error says which."""
    profile = tmp_path / "acceptance"
    profile.write_text("this is not a profile\n")
    out = _plan("--target", "gpt-oss-120b", "--acceptance", str(profile))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "exstill plan: acceptance: not valid TOML (Expected '=' after a key in a key/value pair "
        "(at line 1, column 6))"
    )


def test_plot_without_matplotlib_is_refused_before_any_work(tmp_path: Path) -> None:
    """Where matplotlib is not installed (a matplotlib that cannot be imported stands first on
    the path here), --plot is refused in one line that names the extra; nothing is written."""
    blocker = tmp_path / "site" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    args = ["--target", "gpt-oss-120b", "--acceptance", "seed-qwen3-next"]
    out = subprocess.run(
        [script("exstill"), "plan", *args, "--plot", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "exstill plan: --plot needs matplotlib: pip install 'exstill-sdk[bench]' (or pip install "
        "matplotlib), or leave --plot out"
    )
    assert not (tmp_path / "p").exists()


def test_a_profile_of_the_wrong_kind_or_none_is_named_for_what_it_is() -> None:
    """A shipped card named as a target, a name no shipped target has, a file that is not
    there: each one line saying which, exit 2."""
    cases = {
        ("--target", "exstill-x1"): "exstill-x1 is a shipped card profile: pass it as --card, "
        "not --target",
        ("--target", "nonesuch"): "nonesuch: no such target profile (shipped ones: "
        "deepseek-v4-pro, gpt-oss-120b, kimi-k3, qwen3-next-80b)",
        ("--target", "/nonexistent/t.toml"): "/nonexistent/t.toml: no such file",
        ("--acceptance", "gpt-oss-120b"): "gpt-oss-120b is a shipped target profile: pass it "
        "as --target, not --acceptance",
    }
    for (option, value), said in cases.items():
        args = {"--target": "gpt-oss-120b", "--acceptance": "seed-qwen3-next", option: value}
        out = _plan(*(x for pair in args.items() for x in pair))
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip() == f"exstill plan: {said}"


def test_the_demos_own_json_is_an_acceptance_profile(tmp_path: Path) -> None:
    """exstill plan --acceptance takes what exstill demo --json prints, as it is."""
    # K fixed at 4: a run that drafts (adaptive K on a loaded machine can settle on K = 0,
    # and a run without drafts holds no acceptance)
    args = ["--target", "small", "--max-new-tokens", "48", "--runs", "1", "--k", "4", "--json"]
    demo = subprocess.run(
        [script("exstill"), "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr
    shown = json.loads(demo.stdout)["acceptance_per_position"]
    run = tmp_path / "demo.json"
    run.write_text(demo.stdout)
    out = _plan("--target", "gpt-oss-120b", "--acceptance", str(run), "--json")
    assert out.returncode == 0, out.stderr
    per_position = json.loads(out.stdout)["acceptance"]["per_position"]
    assert per_position[0] == shown[0] and per_position[0] > 0


def test_the_refusal_docs_planning_md_quotes_is_what_the_tool_prints(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    command, quoted = doc.split("$ exstill plan ", 1)[1].split("\n")[:2]
    (tmp_path / "bad.toml").write_text(
        '[target]\nname = "bad"\nsource = "a test"\n[target.pass]\ntokens = [1, 8]\n'
        "ms = [10.0, -1.0]\n"
    )
    out = subprocess.run(
        [script("exstill"), "plan", *command.split()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and out.stderr.strip() == quoted
