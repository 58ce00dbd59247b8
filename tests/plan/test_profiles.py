"""Target and card profiles: the shipped ones load, the model's arithmetic, and every bad field
refused with one error naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exstill_sdk.errors import ExstillError
from exstill_sdk.plan.profiles import (
    SHIPPED,
    ProfileError,
    experts_read,
    load_card,
    load_target,
)

MEASURED = """
[target]
name = "cpu"
[target.pass]
tokens = [1, 8, 16]
ms = [20.0, 24.0, 40.0]
"""

MODELLED = """
[target]
name = "moe"
[target.memory]
weight_bytes = 1e9
expert_bytes = 1e8
experts = 64
active_experts = 4
bandwidth_gb_s = 1000.0
flops_per_token = 1e9
compute_tflops = 100.0
[target.verify]
prefill_tokens_per_s = 10000.0
"""


ANCHORED = """
[target]
name = "moe"
context = 1000
[target.anchor]
tokens_per_s = 500.0
source = "a published speed"
[target.verify]
experts = 64
active_experts = 4
expert_bytes = 1e8
bandwidth_gb_s = 1000.0
kv_bytes_per_token = 1e5
prefill_tokens_per_s = 10000.0
"""


def _write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_shipped_profile_loads() -> None:
    targets = sorted(SHIPPED.glob("targets/*.toml"))
    assert {p.stem for p in targets} >= {"gpt-oss-120b", "qwen3-next-80b"}
    for path in targets:
        t = load_target(path)
        assert t.step_ms(1) > 0
        assert t.verify_ms(1, 7) > t.step_ms(1)  # scoring more tokens costs more
        assert t.verify_ms(16, 112) > t.verify_ms(1, 7)
    card = load_card("exstill-x1")
    assert (card.streams, card.draft_us_per_token, card.prefetch) == (12, 50.0, "outcomes")


@pytest.mark.parametrize(
    ("name", "tokens_per_s"),
    [("gpt-oss-120b", 526), ("qwen3-next-80b", 275), ("deepseek-v4-pro", 100), ("kimi-k3", 104.5)],
)
def test_shipped_targets_are_anchored_to_the_seeds_speeds(name: str, tokens_per_s: float) -> None:
    """Every shipped target's plain step at one user is the seed's published speed, and no
    shipped profile carries a fitted overhead: each step beyond it follows from parts."""
    assert 1000 / load_target(name).step_ms(1) == pytest.approx(tokens_per_s, rel=1e-9)
    for path in SHIPPED.glob("targets/*.toml"):
        assert "overhead" not in path.read_text()


def test_seed_gpt_oss_verification_from_its_parts() -> None:
    """The seed: a chain of 14 verifies in about 2.3 ms against a 1.9 ms step (1.2 plain
    steps); the parts give it without a fitted number."""
    t = load_target("gpt-oss-120b")
    assert t.verify_ms(1, 15) == pytest.approx(2.3, rel=0.05)


def test_planner_defaults_match_the_card_runtime() -> None:
    """The card profile's defaults are the runtime's own (the SDK does not import firmware)."""
    from exstill_sdk.plan import profiles
    from exstill_sdk.protocol.constants import MAX_TREE_NODES
    from firmware import outcomes, runtime

    assert profiles.MAX_K == runtime.DEFAULT_MAX_K
    assert profiles.MAX_OUTCOMES == outcomes.MAX_WIDTH
    assert profiles.OUTCOME_SHARE == outcomes.WINDOW_SHARE
    assert profiles.CANDIDATES == outcomes.CANDIDATES
    card = load_card("exstill-x1")
    assert (card.max_k, card.max_tree_nodes) == (16, MAX_TREE_NODES)
    # trees: priced as chain steps and drafted ahead, the card the seed's figures assume (the
    # runtime drafts a tree when its COMMIT comes: a measured profile says so)
    assert (card.tree_level_us, card.tree_us, card.prefetch_trees) == (None, 0.0, True)
    assert (card.round_us, card.miss_stream_us) == (0.0, 0.0)


def test_measured_pass_table(tmp_path: Path) -> None:
    t = load_target(_write(tmp_path, MEASURED))
    assert t.verify_ms(4, 8) == 24.0
    assert t.verify_ms(4, 12) == pytest.approx(32.0)  # between 8 and 16
    assert t.verify_ms(4, 24) == pytest.approx(56.0)  # the last segment's slope beyond
    assert t.step_ms(1) == 20.0 and t.step_ms(8) == 24.0  # a plain step is a pass of B tokens
    assert t.tree_pass == 1.0  # a tree's pass costs a chain's of as many tokens unless timed
    timed = MEASURED.replace("[target.pass]", "tree_pass = 1.2\n[target.pass]")
    assert load_target(_write(tmp_path, timed)).tree_pass == 1.2


def test_pass_table_by_batch(tmp_path: Path) -> None:
    """Passes measured per batch size: each batch its own curve, a batch between two measured
    ones in between."""
    text = """
[target]
name = "cpu"
[target.pass]
batch = [1, 1, 4, 4]
tokens = [1, 4, 4, 16]
ms = [1.0, 1.2, 2.0, 4.0]
"""
    t = load_target(_write(tmp_path, text))
    assert t.verify_ms(1, 4) == 1.2 and t.verify_ms(4, 4) == 2.0  # same tokens, other batch
    assert t.step_ms(4) == 2.0 and t.step_ms(1) == 1.0
    assert t.verify_ms(2, 4) == pytest.approx(1.2 + (2.0 - 1.2) / 3)
    assert t.verify_ms(8, 16) == 4.0  # beyond the batches measured: the nearest
    assert t.passes is not None  # one batch's passes as a run ran them: that curve scaled
    slowed = t.passes.scaled(4, 1.5)
    assert slowed(4, 16) == 6.0 and slowed(4, 4) == 3.0 and slowed(1, 4) == 1.2
    with pytest.raises(ValueError, match="no curve of 2 sequences"):
        t.passes.scaled(2, 1.5)
    bad = text.replace("batch = [1, 1, 4, 4]", "batch = [1, 1, 4]")
    with pytest.raises(ProfileError, match="one value per measured pass"):
        load_target(_write(tmp_path, bad))
    bad = text.replace("tokens = [1, 4, 4, 16]", "tokens = [1, 4, 2, 16]")
    with pytest.raises(ProfileError, match=r"target\.pass\.batch\[2\]"):
        load_target(_write(tmp_path, bad))


def test_modelled_target_is_the_seed_model(tmp_path: Path) -> None:
    t = load_target(_write(tmp_path, MODELLED))
    read_1 = (1e9 + 4 * 1e8) / 1e12 * 1e3  # one token reads its 4 experts
    assert t.step_ms(1) == pytest.approx(read_1)
    woken = experts_read(7, 64, 4) - experts_read(1, 64, 4)
    expected = t.step_ms(1) + 6 / 10000 * 1e3 + woken * (1e8 / 1e12 * 1e3)
    assert t.verify_ms(1, 7) == pytest.approx(expected)
    assert t.verify_ms(3, 3) == t.step_ms(3)


def test_anchored_target_grows_from_its_parts(tmp_path: Path) -> None:
    """A plain step at one user is the anchor; more sequences add the experts their tokens
    wake, each further sequence's KV cache and its arithmetic; a pass adds the extra tokens'
    arithmetic and experts, the experts counted at 1 - overlap a token."""
    t = load_target(_write(tmp_path, ANCHORED))
    expert_ms = 1e8 / 1e12 * 1e3
    assert t.step_ms(1) == pytest.approx(2.0)
    woken = (experts_read(4, 64, 4) - experts_read(1, 64, 4)) * expert_ms
    kv = 1e5 * 1000 / 1e12 * 1e3
    assert t.step_ms(4) == pytest.approx(2.0 + woken + 3 * (kv + 0.1))
    extra = (experts_read(4 + 12, 64, 4) - experts_read(4, 64, 4)) * expert_ms
    assert t.verify_ms(4, 16) == pytest.approx(t.step_ms(4) + 12 * 0.1 + extra)
    half = load_target(_write(tmp_path, ANCHORED + "expert_overlap = 0.5\n"))
    extra = (experts_read(4 + 6, 64, 4) - experts_read(4, 64, 4)) * expert_ms
    assert half.verify_ms(4, 16) == pytest.approx(t.step_ms(4) + 12 * 0.1 + extra)
    assert half.step_ms(4) == t.step_ms(4)  # other sequences' tokens share nothing


def test_experts_read() -> None:
    assert experts_read(1, 128, 4) == pytest.approx(4)
    assert experts_read(2, 128, 4) == pytest.approx(4 + 4 * (1 - 4 / 128))
    assert experts_read(10_000, 128, 4) == pytest.approx(128)


def test_json_profile(tmp_path: Path) -> None:
    doc = {"target": {"name": "cpu", "pass": {"tokens": [1, 2], "ms": [10, 11]}}}
    t = load_target(_write(tmp_path, json.dumps(doc), "p.json"))
    assert t.verify_ms(1, 2) == 11


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (MODELLED.replace("bandwidth_gb_s = 1000.0\n", ""), "target.memory.bandwidth_gb_s"),
        (MEASURED.replace("20.0, 24.0", "20.0, -24.0"), "target.pass.ms[1]"),
        (MEASURED.replace("[1, 8, 16]", "[1, 16, 8]"), "target.pass.tokens"),
        (MEASURED.replace("[1, 8, 16]", "[1, 8]"), "target.pass.ms"),
        (MEASURED.replace('name = "cpu"\n', ""), "target.name"),
        (MODELLED.replace("active_experts = 4", "active_experts = 65"), "active_experts"),
        (MODELLED.replace("[target.verify]\nprefill_tokens_per_s = 10000.0\n", ""), "verify"),
        (MODELLED.replace("10000.0", '"fast"'), "target.verify.prefill_tokens_per_s"),
        ("[card]\n", "card is not a field here"),
        (MODELLED.replace("compute_tflops", "compute_tf"), "target.memory.compute_tf is not a"),
        (ANCHORED.replace('source = "a published speed"\n', ""), "target.anchor.source"),
        (ANCHORED.replace("context = 1000\n", ""), "target.context is missing"),
        (ANCHORED.replace("bandwidth_gb_s = 1000.0\n", ""), "target.verify.bandwidth_gb_s"),
        (ANCHORED + "expert_overlap = 1.5\n", "target.verify.expert_overlap must be at most 1"),
        (MODELLED + "kv_bytes_per_token = 1.0\n", "kv_bytes_per_token grows an anchored step"),
        (ANCHORED + "[target.memory]\n", "give one of target.memory and target.anchor"),
    ],
)
def test_bad_target_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ProfileError, match=r"p\.toml: .*" + field.replace("[", r"\[")):
        load_target(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"draft_us_per_token": -50}, "card.draft_us_per_token"),
        ({"streams": 0}, "card.streams"),
        ({"prefetch": "sometimes"}, "card.prefetch"),
        ({"link_rtt_us": "fast"}, "card.link_rtt_us"),
        ({"tree_level_us": 0}, "card.tree_level_us"),
        ({"prefetch_trees": "no"}, "card.prefetch_trees"),
    ],
)
def test_bad_card_names_the_field(tmp_path: Path, change: dict, field: str) -> None:
    card = {"name": "c", "streams": 12, "draft_us_per_token": 50, **change}
    path = _write(tmp_path, json.dumps({"card": card}), "c.json")
    with pytest.raises(ProfileError, match=r"c\.json: " + field):
        load_card(path)


def test_missing_profile_lists_the_shipped_ones() -> None:
    with pytest.raises(FileNotFoundError, match="gpt-oss-120b"):
        load_target("no-such-target")


def test_not_toml(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_target(_write(tmp_path, "[target\nname ="))


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=True)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "name",
        "pass",
        "step",
        "memory",
        "verify",
        "tokens",
        "ms",
        "batch",
        "weight_bytes",
        "experts",
        "active_experts",
        "prefill_tokens_per_s",
        "anchor",
        "tokens_per_s",
        "source",
        "expert_overlap",
        "kv_bytes_per_token",
        "bandwidth_gb_s",
        "context",
        "streams",
        "prefetch",
        "max_outcomes",
        "draft_us_per_token",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    target=st.dictionaries(
        fields, values | st.dictionaries(fields, values, max_size=5), max_size=5
    ),
    card=st.dictionaries(fields, values, max_size=5),
)
def test_fuzzed_profiles_load_or_are_refused(tmp_path_factory, target: dict, card: dict) -> None:
    """Whatever a profile holds, loading gives a usable profile or a ProfileError; never
    another exception."""
    folder = tmp_path_factory.mktemp("fuzz")
    for doc, load in (({"target": target}, load_target), ({"card": card}, load_card)):
        path = folder / "f.json"
        path.write_text(json.dumps(doc))
        try:
            profile = load(path)
        except ProfileError:
            continue
        except ExstillError as exc:  # pragma: no cover - the failure this test looks for
            pytest.fail(f"not a ProfileError: {exc!r}")
        if hasattr(profile, "verify_ms"):
            assert math.isfinite(profile.verify_ms(2, 6)) and profile.verify_ms(2, 6) >= 0
