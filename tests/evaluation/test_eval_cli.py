"""exstill eval end to end on tiny real models: a target checkpoint, drafts packed from real
checkpoints, the CLI's JSON and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from exstill_sdk.image.pack import pack_checkpoint

from ..image.checkpoints import save_model

pytest.importorskip("transformers")

HEAD = list(range(0, 96, 2))
"""A frequency-ranked head of the even ids, for the target drafting for itself."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    target = save_model(root / "target", "llama", scale=0.5)
    other = save_model(root / "other", "llama", scale=0.5, seed=1)
    pack_checkpoint(target, root / "self.img", "tiny")
    pack_checkpoint(other, root / "other.img", "tiny")
    pack_checkpoint(target, root / "selfhead.img", "tiny", head_ids=HEAD)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(
                {"category": c, "prompt": " ".join(f"w{(i * 7 + j) % 90}" for j in range(12))}
            )
            + "\n"
            for i, c in enumerate(["a", "a", "b"])
        )
    )
    return {
        "target": target,
        "self": root / "self.img",
        "other": root / "other.img",
        "selfhead": root / "selfhead.img",
        "prompts": prompts,
    }


def _eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exstill_sdk.cli.main", "eval", *args],
        capture_output=True,
        text=True,
    )


def test_eval_reports_every_draft_and_category(pair: dict[str, Path]) -> None:
    out = _eval(
        "--target",
        str(pair["target"]),
        "--draft",
        str(pair["self"]),
        "--draft",
        str(pair["other"]),
        "--draft",
        str(pair["selfhead"]),
        "--prompts",
        str(pair["prompts"]),
        "--new-tokens",
        "24",
        "--max-k",
        "6",
        "--trees",
        "8,4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    drafters = report["drafters"]
    assert report["tree_budgets"] == [4, 8] and report["device"] == "cpu"
    assert list(drafters) == ["self", "other", "selfhead", "prompt lookup"]
    for groups in drafters.values():
        assert list(groups) == ["a", "b", "all"]
        assert groups["a"]["prompts"] == 2 and groups["all"]["prompts"] == 3
    itself = drafters["self"]["all"]
    # the target drafting for itself: every token kept, up to the continuation's end
    assert all(a == 1.0 for a in itself["acceptance_by_depth"])
    tokens, prompts = itself["tokens"], itself["prompts"]
    for k in range(1, 7):  # a pass keeps k + 1 tokens, save each prompt's last one
        assert itself["tau"][str(k)] >= tokens / (tokens / (k + 1) + prompts)
    other = drafters["other"]["all"]
    assert other["tau"]["6"] < itself["tau"]["6"]
    assert 1.0 <= other["tau"]["1"] <= 2.0
    cover = other["coverage_by_depth"]
    assert cover["1"] == other["acceptance_by_depth"]
    assert all(c8 >= c1 for c1, c8 in zip(cover["1"], cover["8"], strict=True))
    assert "coverage_by_depth" not in drafters["prompt lookup"]["all"]
    # top_k: every depth reached together, so between the shallowest and deepest's coverage
    assert len(other["top_k"]) == 8 and other["top_k"] == sorted(other["top_k"])
    for k, pooled in enumerate(other["top_k"], 1):
        assert min(cover[str(k)]) - 1e-4 <= pooled <= max(cover[str(k)]) + 1e-4
    assert "top_k" not in drafters["prompt lookup"]["all"]
    # the target with half its head: it drafts the target's token exactly when it is in the head
    from exstill_sdk.evaluation.prompts import load_prompts
    from exstill_sdk.evaluation.target import (
        encode,
        greedy_continuation,
        load_model,
        load_tokenizer,
    )

    tokenizer, model = load_tokenizer(pair["target"]), load_model(pair["target"])
    continuations = [
        greedy_continuation(model, encode(tokenizer, p), 24) for p in load_prompts(pair["prompts"])
    ]
    inside = sum(t in HEAD for c in continuations for t in c)
    headed = drafters["selfhead"]["all"]
    assert headed["head_coverage"] == round(inside / sum(map(len, continuations)), 4)
    assert 0 < headed["head_coverage"] < 1 and headed["tau"]["6"] < itself["tau"]["6"]
    assert all("head_coverage" not in drafters[d]["all"] for d in ("self", "other"))
    # trees: the chain of N - 1 is the chain's tau at K = N - 1; the card's trees of the target
    # drafting for itself keep its next token every pass, but a chain keeps the most
    for name in ("self", "other", "selfhead"):
        for row in drafters[name].values():
            assert list(row["trees"]) == ["4", "8"]
            assert row["trees"]["4"]["chain"] == row["tau"]["3"]
            for n, shapes in row["trees"].items():
                assert list(shapes) == ["chain", "top2", "top4", "top8", "best_over_chain"]
                assert all(1.0 <= shapes[s] <= int(n) for s in ("top2", "top4", "top8"))
                best = max(shapes["top2"], shapes["top4"], shapes["top8"]) / shapes["chain"]
                assert shapes["best_over_chain"] == pytest.approx(best, abs=1e-3)
    assert "trees" not in drafters["prompt lookup"]["all"]
    # calibration: the images carry the default rank temperature; the target drafting for
    # itself is always right, so the coldest temperature tried fits it best; a draft with a
    # head is fitted on the positions whose token is in its head
    calibration = report["calibration"]
    assert list(calibration) == ["self", "other", "selfhead"]
    assert all(c["rank_temperature"] == 0.5 for c in calibration.values())
    assert calibration["self"]["rank_temperature_fit"] == 0.1
    assert calibration["self"]["positions"] == itself["tokens"] == sum(map(len, continuations))
    assert calibration["selfhead"]["positions"] == inside
    assert 0.1 < calibration["other"]["rank_temperature_fit"] <= 10.0
    for shapes in drafters["self"]["all"]["trees"].values():
        assert 1.0 < shapes["top2"] <= shapes["chain"] and shapes["top4"] <= shapes["chain"]

    table = _eval(
        "--target",
        str(pair["target"]),
        "--draft",
        str(pair["other"]),
        "--prompts",
        str(pair["prompts"]),
        "--new-tokens",
        "8",
        "--no-lookup",
        "--limit",
        "1",
    )
    assert table.returncode == 0, table.stderr
    assert "other" in table.stdout and "K=8" in table.stdout and "prompt lookup" not in table.stdout


def test_eval_mistakes_are_one_line(pair: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = json.loads((pair["target"] / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["renamed"] = tokenizer["model"]["vocab"].pop("w5")
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    foreign = tmp_path / "foreign.img"
    pack_checkpoint(pair["target"], foreign, "tiny", tokenizer=tmp_path / "tokenizer.json")
    cases = [
        (["--draft", str(foreign)], "packed for another tokenizer"),
        (["--draft", str(tmp_path / "none.img")], "none.img"),
        (["--no-lookup"], "nothing to measure"),
        (["--new-tokens", "1"], "--new-tokens must be 2 or more"),
        (["--trees", "8"], "--trees measures a draft's trees: give a --draft"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--draft", str(pair["self"]), "--trees", "1,8"], "--trees budgets must be 2..256"),
        (["--draft", str(pair["self"]), "--trees", "8,x"], "--trees wants numbers"),
    ]
    for extra, message in cases:
        out = _eval("--target", str(pair["target"]), "--prompts", str(pair["prompts"]), *extra)
        assert out.returncode == 2, (extra, out.stderr)
        assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = _eval("--target", str(tmp_path / "nowhere"), "--prompts", str(pair["prompts"]))
    assert out.returncode == 2 and "HF checkpoint directory or a GGUF file" in out.stderr


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exstill_sdk.cli.main", "plan", "--target", "gpt-oss-120b", *args],
        capture_output=True,
        text=True,
    )


def test_plan_reads_the_eval_report(pair: dict[str, Path], tmp_path: Path) -> None:
    """exstill plan --acceptance takes exstill eval's real report: a draft's reach from its
    acceptance by depth, the shares of its other choices from its top-k coverage."""
    args = ["--target", str(pair["target"]), "--prompts", str(pair["prompts"])]
    out = _eval(*args, "--draft", str(pair["other"]), "--new-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    report = tmp_path / "eval.json"
    report.write_text(out.stdout)
    row = json.loads(out.stdout)["drafters"]["other"]["a"]
    # one model draft beside prompt lookup: it needs no name; a category is named after a /
    for given in (str(report), f"{report}#other/a"):
        planned = _plan("--acceptance", given, "--users", "1", "--json")
        assert planned.returncode == 0, planned.stderr
        acceptance = json.loads(planned.stdout)["acceptance"]
        if given.endswith("/a"):
            assert acceptance["source"] == "eval.json#other/a"
            reach, depths = 1.0, row["acceptance_by_depth"]
            for i, a in enumerate(depths):
                reach *= a
                assert acceptance["per_position"][i] == pytest.approx(reach, abs=1e-4)
            top = row["top_k"]
            shares = [(b - a) / (1 - top[0]) for a, b in pairwise(top)]
            assert acceptance["rank_share"] == pytest.approx(shares, abs=1e-4)
        else:
            assert acceptance["source"] == "eval.json#other/all"
    tree = _plan("--acceptance", f"{report}#other", "--users", "1", "--tree", "8", "--json")
    assert tree.returncode == 0, tree.stderr
    assert json.loads(tree.stdout)["rows"][0]["shape"] == "tree of 8"
    # prompt lookup has no ranks: chains only
    lookup = _plan("--acceptance", f"{report}#prompt lookup", "--users", "1", "--tree", "8")
    assert lookup.returncode == 2 and "--tree needs" in lookup.stderr
    two = _eval(*args, "--draft", str(pair["other"]), "--draft", str(pair["self"]), "--json")
    assert two.returncode == 0, two.stderr
    report.write_text(two.stdout)
    for given, message in (
        (str(report), "holds the drafts other, self, prompt lookup: name one"),
        (f"{report}#nobody", "has no draft 'nobody'"),
        (f"{report}#other/c", "has no category 'c'"),
    ):
        out = _plan("--acceptance", given)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
