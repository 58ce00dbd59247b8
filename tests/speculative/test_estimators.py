"""The acceptance estimate that choosing K rests on: one text's counts given the rates over
every text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.speculative.estimators import PositionAcceptance


def test_an_empty_text_is_every_texts_rates() -> None:
    prior = [0.9, 0.7, 0.95, 0.5]
    assert PositionAcceptance(4).rates_given(prior, 2.0) == pytest.approx(prior)


def test_positions_a_text_has_not_reached_follow_the_ones_above() -> None:
    """Every text so far kept deep positions (0.95); this one missed at position 1 or 2 in
    each of eight drafts: its deep positions, never reached, are taken to be like its shallow
    ones, far below 0.95, and a text taken whole is taken to go on whole."""
    prior = [0.7] + [0.95] * 7
    poor = PositionAcceptance(8)
    for accepted in (0, 1, 0, 0, 1, 0, 1, 0):
        poor.observe(8, accepted)
    rates = poor.rates_given(prior, 2.0)
    assert rates[0] < 0.6 and max(rates[2:]) < 0.7
    whole = PositionAcceptance(8)
    for _ in range(3):
        whole.observe(4, 4)  # never drafted beyond position 4
    rates = whole.rates_given([0.5] * 8, 2.0)
    assert min(rates) > 0.75 and rates[7] > rates[0]


@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=40),
    st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
)
def test_rates_are_probabilities(drafts: list[tuple[int, int]], prior: list[float]) -> None:
    counts = PositionAcceptance(8)
    for k, accepted in drafts:
        counts.observe(k, min(k, accepted))
    rates = counts.rates_given(prior, 2.0)
    assert len(rates) == 8 and all(0.0 <= r <= 1.0 for r in rates)
