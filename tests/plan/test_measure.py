"""The measured card profile's parts that are arithmetic on measurements."""

from __future__ import annotations

import pytest

from exstill_sdk.plan.measure.profile import ahead_slowdown, host_line


def test_ahead_slowdown_is_the_median_ratio_to_a_miss_step_at_the_same_streams() -> None:
    card = {"draft_us_per_token": 200.0, "stream_us_per_token": 20.0}
    # one stream: 280 against 200; three: 360 against 240; five: 336 against 280
    assert ahead_slowdown(card, [(1.0, 280.0), (3.0, 360.0), (5.0, 336.0)]) == pytest.approx(1.4)
    assert ahead_slowdown(card, []) == 1.0  # nothing timed: as fast as a miss


def test_host_line_from_runs() -> None:
    assert host_line([(1, 100.0), (3, 140.0)]) == {"us_per_round": 80.0, "us_per_sequence": 20.0}
