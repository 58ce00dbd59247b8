"""Acceptance from profiles and from real runs' JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from exstill_sdk.plan.acceptance import geometric, load_acceptance
from exstill_sdk.plan.profiles import ProfileError
from exstill_sdk.plan.shapes import chain_shape, tree_shape
from exstill_sdk.speculative.metrics import SpecMetrics


def test_seed_acceptance_predicts_its_second_figure() -> None:
    """The seed's 4.18 at K = 6, read as one chance a at every position, gives the +0.46 it
    publishes at K = 8."""
    a = load_acceptance("seed-qwen3-next")
    assert a.mean_length(6) == pytest.approx(4.18, abs=1e-6)
    assert a.mean_length(8) - a.mean_length(6) == pytest.approx(0.46, abs=0.01)


def test_seed_tree_figure_sets_the_rank_shares() -> None:
    """The seed's 7.42 for a tree of 64 is what the shipped profile's rank shares give: the
    best tree of 64 on them keeps 7.42 tokens a pass, the best chain of 64 far fewer."""
    a = load_acceptance("seed-qwen3-next")
    assert tree_shape(a, 64).mean_length == pytest.approx(7.42, abs=1e-3)
    assert chain_shape(a, 64).mean_length < 5.6
    assert a.rank_share[1] / a.rank_share[0] == pytest.approx(1 - a.rank_share[0])
    ranks = a.ranks(1)
    assert ranks[0] == pytest.approx(a.reach[0]) and sum(ranks) <= 1.0


def test_top_k_profile(tmp_path: Path) -> None:
    """top_k: the target's token among the draft's k likeliest; the refusals' shares follow."""
    path = tmp_path / "a.toml"
    path.write_text("[acceptance]\nper_position = [0.8, 0.6]\ntop_k = [0.8, 0.9, 0.95]\n")
    a = load_acceptance(path)
    assert a.rank_share == pytest.approx((0.5, 0.25))
    assert a.ranks(2) == pytest.approx([0.75, 0.125, 0.0625])
    path.write_text("[acceptance]\nper_position = [0.8]\ntop_k = [0.8, 0.7]\n")
    with pytest.raises(ProfileError, match="top_k must not fall"):
        load_acceptance(path)
    path.write_text(
        "[acceptance]\nmean_length = 2\nat_k = 2\ntree_mean_length = 9\ntree_nodes = 8\n"
    )
    with pytest.raises(ProfileError, match="tree_mean_length 9 for 8 nodes is out of reach"):
        load_acceptance(path)


def test_shape_outcomes_add_up() -> None:
    """Every shape's outcomes are every way a round can end: their chances add up to 1, and
    the tokens they keep to the chain's mean length (chains) or 1 + the sum of the nodes'
    values (trees)."""
    a = load_acceptance("seed-qwen3-next")
    for shape in (chain_shape(a, 0), chain_shape(a, 6), tree_shape(a, 12), tree_shape(a, 64)):
        assert shape.chance.sum() == pytest.approx(1.0)
        assert shape.reach(0) == pytest.approx(1.0)
    assert chain_shape(a, 6).mean_length == pytest.approx(a.mean_length(6))
    assert chain_shape(a, 6).reach(3) == pytest.approx(a.at(3))
    plain = load_acceptance("seed-qwen3-next")
    no_ranks = replace(plain, rank_share=())
    chain = chain_shape(no_ranks, 6)
    assert list(chain.named(4)) == [0] and chain.chance[0] == pytest.approx(a.at(7))


def test_per_position_profile_and_extrapolation(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text("[acceptance]\nper_position = [0.8, 0.6, 0.45]\n")
    a = load_acceptance(path)
    assert a.reach == (0.8, 0.6, 0.45)
    assert a.at(4) == pytest.approx(0.45 * 0.75)  # the last step's ratio, on
    assert a.conditional(2) == pytest.approx(0.75)
    assert a.mean_length(3) == pytest.approx(2.85)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("per_position = [0.9, 1.2]", r"acceptance\.per_position\[1\] must be at most 1"),
        ("per_position = [0.5, 0.7]", "must not rise"),
        ("mean_length = 9.0\nat_k = 6", "acceptance.mean_length must be 1..7"),
        ("at_k = 6", "acceptance.per_position is missing"),
        ("mean_length = 3.0", "acceptance.at_k is missing"),
    ],
)
def test_bad_acceptance_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "a.toml"
    path.write_text(f"[acceptance]\n{text}\n")
    with pytest.raises(ProfileError, match=field):
        load_acceptance(path)


def test_from_the_metrics_of_a_run(tmp_path: Path) -> None:
    """SpecMetrics.to_dict, anywhere in a run's JSON (exstill demo --json nests it)."""
    m = SpecMetrics(max_k=4)
    for accepted in (4, 4, 2, 0, 1, 4, 3, 4):
        m.record_round(4, accepted, accepted + 1)
    m.record_round(2, 2, 3)  # adaptive K: a shorter draft reaches fewer positions
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {"metrics": m.to_dict()}, "identical": True}))
    a = load_acceptance(path)
    assert a.reach == pytest.approx(tuple(m.acceptance_per_position))
    assert a.reach[0] == pytest.approx(8 / 9)


def test_a_run_with_its_draft_s_top_k(tmp_path: Path) -> None:
    """exstill-bench profile writes the draft's top_k along a run's text beside its metrics:
    the refusals' shares follow, as from an acceptance profile's top_k."""
    m = SpecMetrics(max_k=2)
    for accepted in (2, 0, 1, 2):
        m.record_round(2, accepted, accepted + 1)
    path = tmp_path / "run-4-users.json"
    for top_k, shares in (([0.6, 0.8, 0.9], (0.5, 0.25)), ([1.0, 1.0], ()), (None, ())):
        path.write_text(json.dumps({"metrics": m.to_dict(), "top_k": top_k}))
        a = load_acceptance(path)
        assert a.reach == pytest.approx(tuple(m.acceptance_per_position))
        assert a.rank_share == pytest.approx(shares)
    for bad, message in (("0.6", "top_k must be a list"), ([0.9, 0.8], "top_k must not fall")):
        path.write_text(json.dumps({"metrics": m.to_dict(), "top_k": bad}))
        with pytest.raises(ProfileError, match=message):
            load_acceptance(path)


def test_from_vllm_counters(tmp_path: Path) -> None:
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps({"num_drafts": 100, "num_accepted_tokens_per_pos": [80, 60, 30]}))
    assert load_acceptance(path).reach == pytest.approx((0.8, 0.6, 0.3))
    # vLLM's SpecDecodingStats: drafts may be shorter than num_speculative_tokens
    stats = {
        "num_spec_tokens": 3,
        "num_drafts": 100,
        "num_accepted_tokens_per_pos": [80, 60, 20],
        "num_draft_tokens_per_pos": [100, 100, 50],
    }
    path.write_text(json.dumps(stats))
    assert load_acceptance(path).reach == pytest.approx((0.8, 0.6, 0.4))


def test_from_the_fixed_k_runs_of_exstill_bench_e2e(tmp_path: Path) -> None:
    fixed = {str(k): {"mean_acceptance_length": v} for k, v in ((1, 1.8), (2, 2.4), (3, 2.8))}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"onnx_target": {"fixed_k": fixed}}))
    assert load_acceptance(path).reach == pytest.approx((0.8, 0.6, 0.4))


def test_a_json_without_acceptance_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": [1, 2]}))
    with pytest.raises(ProfileError, match="no acceptance in it"):
        load_acceptance(path)


def test_geometric_inverts_the_mean_length() -> None:
    assert geometric("t", 1.0, 4).reach == pytest.approx((0, 0, 0, 0), abs=1e-9)
    assert geometric("t", 5.0, 4).mean_length(4) == pytest.approx(5.0)
    assert geometric("t", 2.5, 3).mean_length(3) == pytest.approx(2.5)
