"""The rank temperature fit (support/calibration.py): it recovers the temperature that labels
were drawn at, and leaves out what the draft cannot propose."""

from __future__ import annotations

import numpy as np
import pytest

from exstill_sdk.support.calibration import RANK_GRID, RankTemperatureFit


def drawn_at(temperature: float, rows: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits, and labels drawn from their softmax at ``temperature``."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, (rows, vocab)).astype(np.float32)
    probs = np.exp((logits - logits.max(axis=1, keepdims=True)) / temperature)
    probs /= probs.sum(axis=1, keepdims=True)
    labels = np.array([rng.choice(vocab, p=p) for p in probs])
    return logits, labels


@pytest.mark.parametrize("temperature", [0.45, 1.0, 1.26, 3.0])
def test_the_fit_recovers_the_temperature_labels_were_drawn_at(temperature: float) -> None:
    fit = RankTemperatureFit()
    logits, labels = drawn_at(temperature, 4000, 40, seed=int(temperature * 100))
    for part in range(4):  # added in parts, as distill adds an example at a time
        fit.add(logits[part::4], labels[part::4])
    assert fit.rows == 4000
    best = fit.best()
    assert best is not None
    assert abs(np.log(best / temperature)) < np.log(1.25)  # within two grid steps


def test_rows_the_draft_cannot_propose_are_left_out() -> None:
    logits, labels = drawn_at(1.0, 600, 30, seed=7)
    fit = RankTemperatureFit()
    fit.add(logits, labels)
    masked = logits.copy()
    masked[:, 25:] = -np.inf  # outside a head of 25 tokens
    fit_masked = RankTemperatureFit()
    fit_masked.add(masked, labels)
    inside = labels < 25
    assert fit_masked.rows == int(inside.sum()) < 600
    assert np.isfinite(fit_masked.nll).all()
    fit_labels = RankTemperatureFit()
    fit_labels.add(logits[:, :25], np.where(inside, labels, -1))  # the head's columns alone
    assert fit_labels.rows == fit_masked.rows
    np.testing.assert_allclose(fit_labels.nll, fit_masked.nll, rtol=1e-5)


def test_nothing_added_fits_nothing_and_bad_shapes_are_refused() -> None:
    fit = RankTemperatureFit()
    assert fit.best() is None
    fit.add(np.zeros((2, 5)), np.array([-1, -1]))
    assert fit.best() is None
    with pytest.raises(ValueError, match="one label a row"):
        fit.add(np.zeros((2, 5)), np.array([1]))
    assert RANK_GRID[0] == pytest.approx(0.1) and RANK_GRID[-1] == pytest.approx(10.0)
