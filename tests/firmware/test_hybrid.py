"""Target streams opened with OpenFlags.LOOKUP (firmware/engines/hybrid.py), through the
emulated card with the demo draft: prompt lookup's draft where the text repeats, the model's
elsewhere, and the model kept in step with every committed token whichever drafted it."""

from __future__ import annotations

import pytest

from exstill_sdk.card import Card, open_card
from exstill_sdk.demo import DRAFT_TARGET, emulator_url
from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.protocol.drafts import Verdict

REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
"""Its last 3-gram occurred before: lookup drafts what followed it."""
FRESH = [40, 41, 300, 42, 43, 301, 44, 45]
"""No n-gram occurs twice: the model drafts."""


def model_draft(card: Card, context: list[int], k: int) -> tuple[int, ...]:
    with card.open_stream(target=DRAFT_TARGET) as s:
        s.prefill(context)
        return s.draft(k).tokens


def test_lookup_where_the_text_repeats_and_the_model_elsewhere() -> None:
    with open_card(emulator_url()) as card:
        with card.open_stream(target=DRAFT_TARGET, lookup=True) as s:
            s.prefill(REPEATING)
            draft = s.draft(6)
            assert draft.tokens == (8, 9, 10, 11, 12, 5) and draft.lookup  # the reply says so
        with card.open_stream(target=DRAFT_TARGET, lookup=True) as s:
            s.prefill(FRESH)
            draft = s.draft(6)
            assert draft.tokens == model_draft(card, FRESH, 6) and not draft.lookup


def test_the_model_follows_tokens_that_lookup_drafted() -> None:
    with (
        open_card(emulator_url()) as card,
        card.open_stream(target=DRAFT_TARGET, lookup=True) as s,
    ):
        s.prefill(REPEATING)
        assert s.draft(4).tokens == (8, 9, 10, 11)
        # Three of lookup's tokens accepted, then a token that ends the repeat: the model
        # drafts from a context it never drafted itself, as a fresh stream would.
        after = s.commit(Verdict(3, 300), 5).tokens
        context = [*REPEATING, 8, 9, 10, 300]
        assert after == model_draft(card, context, 5)
        # Rolled back into the repeat, lookup drafts again.
        s.rollback(len(REPEATING))
        assert s.draft(3).tokens == (8, 9, 10)


def test_many_lookup_streams_commit_together() -> None:
    """COMMITs sent in one write: the card drafts the misses as one batch, lookup or model."""
    with open_card(emulator_url()) as card:
        streams = [card.open_stream(target=DRAFT_TARGET, lookup=True) for _ in range(3)]
        contexts = [REPEATING, FRESH, [*FRESH, *FRESH[:4]]]
        drafts = []
        for s, ctx in zip(streams, contexts, strict=True):
            s.prefill(ctx)
            drafts.append(s.draft(4).tokens)
        with card.sent_together():
            rids = [s.send_commit(Verdict(0, 7), 4) for s in streams]
        got = [
            s.receive_commit(rid, Verdict(0, 7)).tokens
            for s, rid in zip(streams, rids, strict=True)
        ]
        for s, ctx, draft in zip(streams, contexts, got, strict=True):
            context = [*ctx, 7]
            with card.open_stream(target=DRAFT_TARGET, lookup=True) as fresh:
                fresh.prefill(context)
                assert draft == fresh.draft(4).tokens
            s.close()


def test_lookup_is_for_target_streams_without_long_context() -> None:
    with open_card(emulator_url()) as card:
        with pytest.raises(InvalidArgumentError, match="LOOKUP is for target streams"):
            card.open_stream("lookup", lookup=True)
        with pytest.raises(InvalidArgumentError, match="long-context"):
            card.open_stream(target=DRAFT_TARGET, lookup=True, long_context=True)
        assert card.stats()["streams_open"] == 0
