"""The rank temperature: the softmax temperature that calibrates a draft's probabilities against
its target's tokens.

The card ranks a tree's nodes and the outcomes it drafts ahead for by the draft's
probabilities (cumulative along a path), so those probabilities should say how often the
draft is right. A small draft seldom is calibrated: the demo draft is right more often than its
softmax says (its calibrated temperature is 0.45), SmolLM2's distilled draft less often (1.26),
and at the wrong temperature a tree spends its nodes on the wrong branches. The temperature
fitted here minimises the mean negative log-likelihood of the target's own tokens under the
draft's softmax (temperature scaling, the standard one-parameter calibration), over a grid of
temperatures: ``exstill distill`` fits it on held-out answers and packs it in the image
(``draft.rank_temperature``), ``exstill eval`` reports it for the prompts it scores.
"""

from __future__ import annotations

import numpy as np

RANK_GRID = tuple(float(t) for t in np.geomspace(0.1, 10.0, 41))
"""The temperatures tried: 0.1 to 10, each 12% above the one before."""
CHUNK_ROWS = 256
"""Rows scored at once (a row is the vocabulary's logits)."""


class RankTemperatureFit:
    """The negative log-likelihood of the target's tokens at each of ``RANK_GRID``'s
    temperatures, summed over the rows added."""

    def __init__(self) -> None:
        self.nll = np.zeros(len(RANK_GRID))
        self.rows = 0

    def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """Rows of the draft's logits ([n, vocab]; minus infinity for tokens it cannot
        propose, outside a frequency-ranked head) and the target's token at each (a negative
        label: one outside what the draft can propose). Rows whose token the draft cannot
        propose are left out: no temperature makes them likelier."""
        logits = np.asarray(logits, np.float32)
        labels = np.asarray(labels, np.int64)
        if logits.ndim != 2 or labels.shape != (len(logits),):
            raise ValueError("logits must be [n, vocab] with one label a row")
        inside = labels >= 0
        logits, labels = logits[inside], labels[inside]
        picked = logits[np.arange(len(labels)), labels]
        proposable = np.isfinite(picked)
        logits, picked = logits[proposable], picked[proposable]
        for start in range(0, len(logits), CHUNK_ROWS):
            rows = logits[start : start + CHUNK_ROWS]
            top = rows.max(axis=1, keepdims=True)
            shifted = rows - top
            gap = picked[start : start + CHUNK_ROWS] - top[:, 0]  # <= 0
            for i, t in enumerate(RANK_GRID):
                log_sum = np.log(np.exp(shifted / np.float32(t)).sum(axis=1, dtype=np.float64))
                self.nll[i] += float((log_sum - gap / t).sum())
        self.rows += len(logits)

    def best(self) -> float | None:
        """The temperature of least negative log-likelihood; None before any row."""
        if not self.rows:
            return None
        return round(RANK_GRID[int(np.argmin(self.nll))], 3)
