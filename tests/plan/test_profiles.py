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
overhead_ms = 2.0
[target.verify]
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
    assert (card.streams, card.draft_us_per_token, card.prefetch) == (12, 50.0, "full-acceptance")


def test_shipped_qwen3_next_step_is_the_published_275_tokens_per_s() -> None:
    assert 1000 / load_target("qwen3-next-80b").step_ms(1) == pytest.approx(275, rel=0.01)


def test_measured_pass_table(tmp_path: Path) -> None:
    t = load_target(_write(tmp_path, MEASURED))
    assert t.verify_ms(4, 8) == 24.0
    assert t.verify_ms(4, 12) == pytest.approx(32.0)  # between 8 and 16
    assert t.verify_ms(4, 24) == pytest.approx(56.0)  # the last segment's slope beyond
    assert t.step_ms(1) == 20.0 and t.step_ms(8) == 24.0  # a plain step is a pass of B tokens


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
    bad = text.replace("batch = [1, 1, 4, 4]", "batch = [1, 1, 4]")
    with pytest.raises(ProfileError, match="one value per measured pass"):
        load_target(_write(tmp_path, bad))
    bad = text.replace("tokens = [1, 4, 4, 16]", "tokens = [1, 4, 2, 16]")
    with pytest.raises(ProfileError, match=r"target\.pass\.batch\[2\]"):
        load_target(_write(tmp_path, bad))


def test_modelled_target_is_the_seed_model(tmp_path: Path) -> None:
    t = load_target(_write(tmp_path, MODELLED))
    read_1 = (1e9 + 4 * 1e8) / 1e12 * 1e3  # one token reads its 4 experts
    assert t.step_ms(1) == pytest.approx(2.0 + read_1)
    woken = experts_read(7, 64, 4) - experts_read(1, 64, 4)
    expected = t.step_ms(1) + 6 / 10000 * 1e3 + woken * (1e8 / 1e12 * 1e3)
    assert t.verify_ms(1, 7) == pytest.approx(expected)
    assert t.verify_ms(3, 3) == t.step_ms(3)


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
        (MODELLED.replace("overhead_ms", "overhead_mss"), "target.memory.overhead_mss is not a"),
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
        "streams",
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
