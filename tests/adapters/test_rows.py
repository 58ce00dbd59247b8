"""RowStreams against the built-in emulator: a simulated serving engine's batch whose rows
accept drafts, finish, move (compaction), arrive mid-run and sit in prefill."""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import numpy as np
import pytest

from exstill_sdk.adapters.rows import RowStreams
from exstill_sdk.adapters.vllm import (
    ExstillProposer,
    ProposerSettings,
    card_settings,
    choose_draft,
)
from exstill_sdk.card import open_card
from exstill_sdk.errors import InvalidArgumentError, TokenizerMismatchError, UnknownModelError

from ..helpers import served

K = 4
WIDTH = 256


def reference(r: int, n: int = 120) -> list[int]:
    """Request r's whole output: periodic with a twist, so lookup drafts are often right."""
    period = 5 + r
    return [10 + r * 20 + (j % period) + (j // 40) for j in range(n)]


class Batch:
    """The engine side: rows of token ids, compacted when a request finishes (as vLLM's
    input batch does)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, r: int, prompt_len: int = 12) -> None:
        self.rows.append({"r": r, "tokens": reference(r)[:prompt_len], "sampled": [], "draft": []})

    def step(self, finish: set[int] = frozenset()) -> None:
        """Verify each row's draft against its reference: accept the matching prefix, then the
        reference's next token."""
        for row in self.rows:
            ref = reference(row["r"])
            pos = len(row["tokens"])
            accepted = 0
            for t in row["draft"]:
                if ref[pos + accepted] != t:
                    break
                accepted += 1
            row["sampled"] = ref[pos : pos + accepted + 1]
            row["tokens"] = ref[: pos + accepted + 1]
        for row in [row for row in self.rows if row["r"] in finish]:
            i = self.rows.index(row)
            last = self.rows.pop()
            if last is not row:
                self.rows[i] = last  # the last row moves into the hole

    def arrays(self) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
        tokens = np.zeros((len(self.rows) + 2, WIDTH), np.int32)  # spare rows, like vLLM
        lengths = np.zeros(len(self.rows) + 2, np.int32)
        for i, row in enumerate(self.rows):
            tokens[i, : len(row["tokens"])] = row["tokens"]
            lengths[i] = len(row["tokens"])
        return [row["sampled"] for row in self.rows], lengths, tokens


def fresh_draft(card, context: list[int], k: int) -> list[int]:
    with card.open_stream("lookup") as s:
        s.prefill(context)
        return list(s.draft(k).tokens)


def test_rows_follow_requests_through_commits_compaction_and_arrivals() -> None:
    with open_card("emu://") as card:
        rows = RowStreams(card, engine="lookup")
        batch = Batch()
        for r in range(3):
            batch.add(r)
        for r in range(3):  # the prompt's step: each row samples its first token
            batch.rows[r]["sampled"] = [reference(r)[12]]
            batch.rows[r]["tokens"] = reference(r)[:13]
        proposals = 0
        with_stream: set[int] = set()
        for step in range(14):
            if step == 3:
                batch.add(3)  # arrives: in prefill this step (nothing sampled)
            if step == 8:
                batch.rows[1]["sampled"] = []  # re-prefilling this step: keeps its stream
            sampled, lengths, tokens = batch.arrays()
            drafts = rows.propose(sampled, lengths, tokens, K, max_length=WIDTH)
            assert len(drafts) == len(batch.rows)
            for row, draft in zip(batch.rows, drafts, strict=True):
                if row["sampled"]:
                    assert draft == fresh_draft(card, row["tokens"], K)
                    proposals += 1
                    with_stream.add(row["r"])
                else:
                    assert draft == []
                row["draft"] = draft
            assert card.stats()["streams_open"] == len(with_stream)
            if step == 6:
                batch.step(finish={0})
                with_stream.discard(0)
            else:
                batch.step()
        # Request 0 finished and request 3 (last row) moved into row 0: its stream followed it.
        assert [row["r"] for row in batch.rows] == [3, 1, 2]
        stats = rows.stats
        assert stats.opened == 4  # one per request: no stream re-opened after the move
        assert stats.closed == 1  # request 0's
        # Each request's prompt, and request 1 once: its tokens grew in the step it sampled
        # nothing, so the next step is not one round on from its stream and it re-synchronises.
        assert stats.prefills == 5
        assert stats.commits == proposals - 5
        rows.close()
        assert card.stats()["streams_open"] == 0


def test_a_row_that_changed_request_resynchronises() -> None:
    with open_card("emu://") as card:
        rows = RowStreams(card, engine="lookup")
        a, b = reference(0)[:30], reference(5)[:30]
        lengths = np.array([30])
        first = rows.propose([[a[-1]]], lengths, np.array([a]), K)
        assert first[0] == fresh_draft(card, a, K)
        # Row 0 now holds another request (the old one was preempted): the stream is reused,
        # rolled back to the common prefix and refilled.
        second = rows.propose([[b[-1]]], lengths, np.array([b]), K)
        assert second[0] == fresh_draft(card, b, K)
        assert (rows.stats.opened, rows.stats.prefills) == (1, 2)
        # Rows beyond the card's slot get no draft, and the batch keeps going.
        long = np.array([reference(1, 300)])
        capacity = card.info().context
        assert rows.propose([[1]], np.array([capacity]), np.zeros((1, capacity), np.int64), K) == [
            []
        ]
        assert rows.propose([[long[0, 99]]], np.array([100]), long, K)[0]
        rows.close()


def test_more_rows_than_streams_go_without_drafts() -> None:
    with open_card("emu://?streams=2") as card:
        rows = RowStreams(card, engine="lookup")
        contexts = np.array([reference(r)[:20] for r in range(3)])
        drafts = rows.propose([[c[-1]] for c in contexts], np.full(3, 20), contexts, K)
        assert [bool(d) for d in drafts] == [True, True, False]
        assert rows.stats.no_stream == 1
        rows.close()


def config(**additional: object) -> SimpleNamespace:
    """The fields of vLLM's VllmConfig that the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 4096),
        additional_config=additional,
    )


def test_proposer_settings_come_from_vllm_config_then_environment(monkeypatch) -> None:
    monkeypatch.setenv("EXSTILL_CARD_URL", "emu://?streams=3")
    monkeypatch.delenv("EXSTILL_DRAFT", raising=False)
    monkeypatch.delenv("EXSTILL_K", raising=False)
    monkeypatch.delenv("EXSTILL_LOOKUP", raising=False)
    assert card_settings(config()) == ProposerSettings("emu://?streams=3", None, adaptive=False)
    assert card_settings(config(exstill={"model_k": 0})).model_k is None  # no cap
    with pytest.raises(InvalidArgumentError, match="a whole number"):
        card_settings(config(exstill={"model_k": "two"}))
    chosen = {"url": "tcp://h:1", "draft": "d", "k": "adaptive", "lookup": False}
    assert card_settings(config(exstill=chosen)) == (
        ProposerSettings("tcp://h:1", "d", adaptive=True, lookup=False)
    )
    monkeypatch.delenv("EXSTILL_CARD_URL")
    monkeypatch.setenv("EXSTILL_K", "adaptive")
    monkeypatch.setenv("EXSTILL_LOOKUP", "0")
    assert card_settings(config()) == ProposerSettings("emu://", None, True, lookup=False)
    with pytest.raises(InvalidArgumentError, match="use one of adaptive, fixed"):
        card_settings(config(exstill={"k": "8"}))
    with pytest.raises(InvalidArgumentError, match="use true or false"):
        card_settings(config(exstill={"lookup": "maybe"}))


def test_proposer_drafts_with_the_cards_image_and_checks_the_vocabulary() -> None:
    from exstill_sdk.demo import emulator_url

    url = emulator_url()
    proposer = ExstillProposer(config(exstill={"url": url, "k": "fixed"}))
    proposer.load_model(object())
    assert proposer.rows is not None and proposer.rows.draft_target == "demo-draft"
    ctx = np.array([reference(0)[:20]])
    drafts = proposer.propose([[ctx[0, -1]]], np.array([20]), ctx)
    assert len(drafts) == 1 and len(drafts[0]) == 2  # a model draft: model_k caps it
    from prometheus_client import REGISTRY

    on = {"card": url}
    assert REGISTRY.get_sample_value("exstill_rows_prefills_total", on) == 1
    assert REGISTRY.get_sample_value("exstill_streams_opened_total", on) == 1
    proposer.close()
    assert REGISTRY.get_sample_value("exstill_rows_prefills_total", on) is None
    with open_card(url) as card:
        with pytest.raises(UnknownModelError, match="no target 'nope'"):
            choose_draft(card, "nope", 4096)
        with pytest.raises(TokenizerMismatchError, match="4096 tokens"):
            choose_draft(card, None, 32000)
    with open_card("emu://") as card:
        assert choose_draft(card, None, 4096) is None  # no image: prompt lookup


def test_a_refused_row_goes_without_drafts_then_reopens() -> None:
    with open_card("emu://?max_k=3") as card:
        rows = RowStreams(card, engine="lookup")
        contexts = np.array([reference(r)[:20] for r in range(2)])
        drafts = rows.propose([[c[-1]] for c in contexts], np.full(2, 20), contexts, 8)
        assert [len(d) for d in drafts] == [3, 3]  # K clipped to the card's max_k
        rows._rows[0].stream.close()  # the card no longer knows row 0's stream
        grown = np.array([[*c, *d, 1] for c, d in zip(contexts.tolist(), drafts, strict=True)])
        n = np.full(2, grown.shape[1])
        drafts = rows.propose([[*d, 1] for d in drafts], n, grown, 3)
        assert drafts[0] == [] and drafts[1] == fresh_draft(card, grown[1].tolist(), 3)
        assert rows.stats.errors == 1
        again = rows.propose([[1], [1]], n, grown, 3)  # row 0 re-opens and re-prefills
        assert again == [fresh_draft(card, g.tolist(), 3) for g in grown]
        assert rows.stats.opened == 3
        rows.close()


def test_a_card_reset_costs_one_step_without_drafts() -> None:
    from exstill_firmware import CardRuntime

    with ExitStack() as stack:
        server = stack.enter_context(served(CardRuntime(background_prefetch=False)))
        card = stack.enter_context(open_card(server.url))
        rows = RowStreams(card, engine="lookup")
        contexts = np.array([reference(r)[:30] for r in range(3)])
        n = np.full(3, 30)
        first = rows.propose([[c[-1]] for c in contexts], n, contexts, 4)
        assert all(first)
        server.close()  # the card restarts (its port is free at once), on the same port
        with served(CardRuntime(background_prefetch=False), port=server.port):
            assert rows.propose([[c[-1]] for c in contexts], n, contexts, 4) == [[], [], []]
            assert rows.stats.reconnects == 1
            again = rows.propose([[c[-1]] for c in contexts], n, contexts, 4)
            assert again == first
            rows.close()


def test_a_full_card_is_not_asked_for_a_stream_every_step() -> None:
    """Eight requests on a 3-stream card for 20 steps: the five without a stream ask again
    only after a stream was closed here, so the card refuses a handful of opens, not one per
    row per step; drafts keep flowing for the three that have one."""
    with open_card("emu://?streams=3") as card:
        rows = RowStreams(card, engine="lookup")
        batch = Batch()
        for r in range(8):
            batch.add(r)
        drafted = 0
        for step in range(20):
            sampled, lengths, tokens = batch.arrays()
            if step == 0:
                sampled = [row["tokens"][-1:] for row in batch.rows]
            drafts = rows.propose(sampled, lengths, tokens, K)
            drafted += sum(bool(d) for d in drafts)
            for row, d in zip(batch.rows, drafts, strict=False):
                row["draft"] = d
            batch.step(finish={0} if step == 10 else set())  # a request ends: a stream frees
        refused = card.stats()["errors.card_full"]
        rows.close()
    assert drafted > 0
    assert refused <= 3
    assert rows.stats.no_stream >= 4 * 19


def misleading(n: int = 400) -> list[int]:
    """Text whose repeated bigrams are followed by a different token each time: prompt lookup
    drafts for it, and its drafts are wrong."""
    out: list[int] = []
    for c in range(n // 6):
        out += [20, 21, 100 + c, 22, 23, 200 + c]
    return out


class SimulatedClock:
    """The engine's time: advanced by the simulated step's cost, not by the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_adaptive_rows_draft_what_pays_for_itself() -> None:
    """With the planner, a row whose drafts are accepted drafts long and a row whose drafts are
    wrong stops drafting; the engine's step costs a fixed part and a part per token, as a
    memory-bound target's pass does (on RowStreams' clock, which times the step between calls:
    the verdict does not depend on how loaded the machine is)."""
    texts = [[10 + j % 6 for j in range(400)], misleading()]
    clock = SimulatedClock()
    with open_card("emu://") as card:
        rows = RowStreams(card, engine="lookup", adaptive=True, clock=clock)
        held = [t[:20] for t in texts]
        sampled = [[t[-1]] for t in held]
        lengths: list[list[int]] = [[], []]
        for step in range(60):
            tokens = np.zeros((2, 400), np.int64)
            for i, t in enumerate(held):
                tokens[i, : len(t)] = t
            drafts = rows.propose(sampled, np.array([len(t) for t in held]), tokens, 6)
            clock.now += 0.004 + 0.001 * sum(len(d) + 1 for d in drafts)
            for i, (text, draft) in enumerate(zip(texts, drafts, strict=True)):
                pos, accepted = len(held[i]), 0
                while accepted < len(draft) and text[pos + accepted] == draft[accepted]:
                    accepted += 1
                sampled[i] = text[pos : pos + accepted + 1]
                held[i] = text[: pos + accepted + 1]
                if step >= 40:
                    lengths[i].append(len(draft))
        assert rows.planner is not None and rows.planner.passes > 40
        assert sum(lengths[0]) / 20 >= 4  # lookup is right on periodic text: long drafts
        assert sum(lengths[1]) / 20 <= 1  # and wrong on the other: about none
        rows.close()


def test_with_lookup_the_models_drafts_are_capped_and_lookups_are_not() -> None:
    from exstill_sdk.demo import DRAFT_TARGET, emulator_url

    repeating = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    fresh = [40, 41, 300, 42, 43, 301, 44, 45]
    with open_card(emulator_url()) as card:
        rows = RowStreams(card, draft=DRAFT_TARGET, lookup=True, model_k=2)
        tokens = np.zeros((2, 64), np.int64)
        tokens[0, :24], tokens[1, :8] = repeating, fresh
        first = rows.propose([[12], [45]], np.array([24, 8]), tokens, 6)
        assert [len(d) for d in first] == [2, 2]  # new rows: as if the model drafts
        assert first[0] == [5, 6]  # but lookup did, so next time the row drafts K
        tokens[0, 24:27] = [5, 6, 7]
        tokens[1, 8] = 99  # the model's draft rejected
        second = rows.propose([[5, 6, 7], [99]], np.array([27, 9]), tokens, 6)
        assert second[0] == [8, 9, 10, 11, 12, 5] and len(second[1]) == 2
        rows.close()
    with pytest.raises(InvalidArgumentError, match="1 or more"):
        RowStreams(card, draft=DRAFT_TARGET, lookup=True, model_k=0)
