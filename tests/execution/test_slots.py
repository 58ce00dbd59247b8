"""The slot runner: rows fed in one run, in any order and any subset, as if fed alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.runner import OnnxDecoder
from exstill_sdk.execution.slots import Feed, SlotRunner
from exstill_sdk.image import open_image
from tests.helpers import tiny_image


def test_changing_subsets_of_rows_match_rows_fed_alone(tmp_path: Path) -> None:
    image = open_image(tiny_image(tmp_path / "tiny.img"))
    batched, alone = OnnxDecoder(image, 4, 96), OnnxDecoder(image, 4, 96)
    slots = SlotRunner(image, batched)
    rng = np.random.default_rng(3)
    lengths = [0, 0, 0, 0]
    for rows in ([0, 1, 2, 3], [2], [3, 1], [1, 0, 2], [0, 3]):
        feeds = [Feed(r, rng.integers(0, 64, int(rng.integers(1, 6))), lengths[r], 2) for r in rows]
        feeds = [f._replace(last=min(f.last, len(f.tokens))) for f in feeds]
        for feed, logits in zip(feeds, slots.run(feeds), strict=True):
            want = alone.prefill(feed.row, feed.tokens, feed.start, last=feed.last)
            assert np.abs(logits - want).max() <= 1e-4
            lengths[feed.row] += len(feed.tokens)


def test_a_row_fed_twice_is_refused(tmp_path: Path) -> None:
    image = open_image(tiny_image(tmp_path / "tiny.img"))
    slots = SlotRunner(image, OnnxDecoder(image, 2, 32))
    feed = Feed(0, np.array([1, 2]), 0, 1)
    with pytest.raises(InvalidArgumentError, match="fed twice"):
        slots.run([feed, feed])
