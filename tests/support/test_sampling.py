"""One shaping of a distribution for the host's p and the card's q, with one tie rule."""

from __future__ import annotations

import numpy as np
import pytest
from exstill_firmware.engines.base import Sampling
from exstill_firmware.engines.sampling import WEIGHT_SCALE, distribution
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.support.sampling import SamplingParams, shaped_probs


def test_top_k_keeps_every_token_tied_at_the_kth_value() -> None:
    logits = np.array([3.0, 2.0, 2.0, 1.0, 2.0])
    p = shaped_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 4 and p[3] == 0  # the three tied at 2.0 all stay
    ids, _ = distribution(logits, Sampling(temperature=1.0, top_k=2))
    assert sorted(ids.tolist()) == [0, 1, 2, 4]  # the card keeps the same tokens


@given(
    st.lists(st.integers(-8, 8), min_size=2, max_size=40),
    st.floats(0.3, 2.0),
    st.integers(0, 10),
    st.sampled_from([1.0, 0.9, 0.5]),
)
def test_the_cards_q_is_the_hosts_shaping_quantised(
    values: list[int], temperature: float, top_k: int, top_p: float
) -> None:
    logits = np.array(values, np.float64) / 2  # many ties
    p = shaped_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    ids, weights = distribution(logits, Sampling(temperature=temperature, top_k=top_k, top_p=top_p))
    q = np.zeros_like(p)
    q[ids] = weights / weights.sum()
    assert set(ids.tolist()) <= set(np.flatnonzero(p).tolist())
    assert np.abs(q - p).max() <= 2 / WEIGHT_SCALE * len(ids)  # u16 quantisation only


def test_both_sides_refuse_the_same_values() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}):
        with pytest.raises(InvalidArgumentError):
            SamplingParams(**bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            Sampling(**bad)  # type: ignore[arg-type]
