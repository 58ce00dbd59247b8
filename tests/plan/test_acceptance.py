"""Acceptance from profiles and from real runs' JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exstill_sdk.plan.acceptance import geometric, load_acceptance
from exstill_sdk.plan.profiles import ProfileError
from exstill_sdk.speculative.metrics import SpecMetrics


def test_seed_acceptance_predicts_its_second_figure() -> None:
    """The seed's 4.18 at K = 6, read as one chance a at every position, gives the +0.46 it
    publishes at K = 8."""
    a = load_acceptance("seed-qwen3-next")
    assert a.mean_length(6) == pytest.approx(4.18, abs=1e-6)
    assert a.mean_length(8) - a.mean_length(6) == pytest.approx(0.46, abs=0.01)


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
