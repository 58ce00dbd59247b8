"""The measured card profile's parts that are arithmetic on measurements."""

from __future__ import annotations

from exstill_sdk.plan.measure.profile import ahead_line, host_line, round_costs
from exstill_sdk.speculative.estimators import Line


def test_drafting_ahead_is_a_line_in_the_streams_the_card_timed() -> None:
    card = {"draft_us_per_token": 200.0, "stream_us_per_token": 20.0}
    # steps of 1, 3 and 5 streams at 280, 340 and 400 us: 280 and 30 a further stream
    line = ahead_line(card, [(1.0, 280.0), (3.0, 340.0), (5.0, 400.0)])
    assert line == {"ahead_us_per_token": 280.0, "ahead_stream_us_per_token": 30.0}
    # one stream count: its step, less the miss line's further streams
    assert ahead_line(card, [(3.0, 340.0)]) == {
        "ahead_us_per_token": 300.0,
        "ahead_stream_us_per_token": 20.0,
    }
    assert ahead_line(card, []) == {}  # nothing timed: the miss rates


def test_an_outcome_tree_s_pass_is_a_line_in_its_outcomes_the_card_timed() -> None:
    from exstill_sdk.plan.measure.profile import outcome_line

    card = {"draft_us_per_token": 200.0, "ahead_us_per_token": 240.0}
    # passes of 1 and 3 outcomes at 500 and 620 us: 440 fixed, 60 an outcome
    line = outcome_line(card, [(1.0, 500.0), (3.0, 620.0)])
    assert line == {"outcome_pass_us": 440.0, "outcome_us": 60.0}
    # one width seen: half of it fixed, as the card runtime's own fit takes it
    assert outcome_line(card, [(2.0, 600.0), (2.0, 400.0)]) == {
        "outcome_pass_us": 250.0,
        "outcome_us": 125.0,
    }
    # mean widths less than an outcome apart: one width, their means
    assert outcome_line(card, [(1.0, 500.0), (1.5, 700.0)]) == {
        "outcome_pass_us": 300.0,
        "outcome_us": 240.0,
    }
    # none timed: the runtime's prior, two steps of drafting ahead and a quarter step each
    assert outcome_line(card, []) == {"outcome_pass_us": 480.0, "outcome_us": 60.0}


def test_host_line_from_runs() -> None:
    assert host_line([(1, 100.0), (3, 140.0)]) == {"us_per_round": 80.0, "us_per_sequence": 20.0}


def test_table_ms_interpolates_one_batchs_passes_and_retime_replaces_them() -> None:
    from exstill_sdk.plan.measure.profile import table_ms

    rows = {"batch": [1, 1, 1, 4, 4], "tokens": [1, 5, 9, 4, 36], "ms": [2.0, 3.0, 5.0, 6.0, 9.0]}
    doc = {"target": {"pass": rows}}
    assert table_ms(doc, 1, 7) == 4.0  # between 5 tokens (3 ms) and 9 (5 ms)
    assert table_ms(doc, 4, 36) == 9.0
    assert table_ms(doc, 1, 1) == 2.0


def test_round_costs_from_hits_and_misses_on_one_stream_and_on_all() -> None:
    """Hits of 150 us on one stream and 370 on 12: 20 a COMMIT, 130 the round; misses a line
    of 500 + 100 a step on one stream, 1270 + 320 a step on 12: 350 more than a hit to draft
    anew, 50 more for each further stream, 20 a step for each further stream."""
    costs = round_costs([150.0, 370.0], [Line(500.0, 100.0), Line(1270.0, 320.0)], 12)
    assert costs == {
        "draft_us_per_token": 100.0,
        "stream_us_per_token": 20.0,
        "round_us": 130.0,
        "commit_us": 20.0,
        "miss_us": 350.0,
        "miss_stream_us": 50.0,
    }
    # noise that would make a cost negative holds it at 0
    assert round_costs([150.0, 100.0], [Line(100.0, 100.0), Line(50.0, 90.0)], 12) == {
        "draft_us_per_token": 100.0,
        "stream_us_per_token": 0.0,
        "round_us": 150.0,
        "commit_us": 0.0,
        "miss_us": 0.0,
        "miss_stream_us": 0.0,
    }


def test_the_card_s_rounds_are_timed_only_when_the_card_counted_them_as_meant() -> None:
    """The profile's hit rounds commit the card's own guess, which it drafted ahead for (the
    TCP emulator drafts ahead before it reads the next request: no timing in it); its miss
    rounds a random bonus; a round the card's counters call otherwise is left out. Each round
    leaves the stream's context as it found it."""
    import numpy as np

    from exstill_sdk.demo import DRAFT_TARGET
    from exstill_sdk.harness.demo_setup import demo_card
    from exstill_sdk.plan.measure.profile import _hit_verdicts, _miss_verdicts, _round_us

    with demo_card(1) as (card, prompts), card.open_stream(target=DRAFT_TARGET) as s:
        vocab = {t.name: t.vocab_size for t in card.info().targets}[DRAFT_TARGET]
        rng = np.random.default_rng(0)
        length = s.prefill(prompts[0])
        for k in (1, 4):
            before = card.stats()
            assert len(_round_us(card, [s], k, _hit_verdicts([s], k), hit=True)) == 1
            missed = _round_us(card, [s], k, _miss_verdicts([s], k, vocab, rng), hit=False)
            after = card.stats()
            assert len(missed) == 1 and s.length == length
            assert after["prefetch_hits"] - before["prefetch_hits"] == 1
            assert after["prefetch_misses"] - before["prefetch_misses"] == 1
        # the card's guess committed where a miss was meant: not a miss, not timed
        assert _round_us(card, [s], 4, _hit_verdicts([s], 4), hit=False) == []
        assert _round_us(card, [s], 4, None, hit=True) == []  # a draft that came out short


def test_draft_top_k_along_the_target_s_text_and_the_draft_s_own() -> None:
    """The card's draft run by onnxruntime along a text: its own greedy text is its top-1
    everywhere; the demo target's text is not, and a wider k covers more of it."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.demo.pair import POSITIONS, demo_dir, draft_model
    from exstill_sdk.harness.demo_setup import user_prompts
    from exstill_sdk.image.reader import open_image
    from exstill_sdk.plan.measure.draft_ranks import draft_top_k

    prompts = user_prompts(3, 64)
    draft = draft_model()
    own = [draft.greedy(p, 40) for p in prompts]
    assert draft_top_k(draft, prompts, own, 8) == [1.0] * 8
    target = OnnxTarget(open_image(demo_dir() / "target.img"), max_sequences=3, positions=POSITIONS)
    texts = target.greedy_batch(prompts, 40)
    top_k = draft_top_k(draft, prompts, texts, 8)
    assert len(top_k) == 8 and top_k[0] < 1.0 and top_k == sorted(top_k) and top_k[-1] <= 1.0
    assert top_k[1] > top_k[0]  # the second choice catches some of the refusals
    assert draft_top_k(draft, prompts, [[], [], []], 8) == []


def test_the_check_s_acceptance_is_counted_over_its_decode_window(tmp_path) -> None:
    """The rounds of a speculative run while every user decodes (the window its tokens/s
    counts), as the counters ``--acceptance`` reads: rounds of 3, 1, 2 and 3 tokens at K = 2
    accepted 2, 0, 1 and 2 drafted tokens."""
    import json

    from exstill_sdk.bench.decode.users import decode_rate
    from exstill_sdk.plan import load_acceptance
    from exstill_sdk.plan.measure.check import window_counters

    counters = window_counters([3, 1, 2, 3], 2)
    assert counters == {"num_drafts": 4, "num_accepted_tokens_per_pos": [3, 2]}
    path = tmp_path / "window.json"
    path.write_text(json.dumps({"metrics": counters}))
    assert load_acceptance(path).reach == (0.75, 0.5)
    # two users, 4 tokens each: user 1's first round opens the window, user 0's round that
    # completes its 4 tokens closes it; the rounds before and after are not the window's
    events = [(0, [1, 2, 3]), (1, [4]), (1, [5, 6]), (0, [7]), (1, [8])]
    rounds: list[int] = []
    _, outs = decode_rate(lambda: iter(events), 2, 4, 0.0, rounds)
    assert rounds == [2, 1] and outs == [[1, 2, 3, 7], [4, 5, 6, 8]]


def test_the_check_s_slowdown_is_the_run_s_steady_passes_against_the_table(tmp_path) -> None:
    """A decoder's passes through ``RecordedPasses``: a sequence's first pass (its prompt) is
    left out (a released index's next first pass too), the others are recorded by sequences
    and tokens; their time over the table's for the same passes (a tree's at ``tree_pass``) is
    the row's slowdown."""
    import json

    import pytest

    from exstill_sdk.harness.passes import Pass, RecordedPasses
    from exstill_sdk.plan import load_target
    from exstill_sdk.plan.measure.check import in_run_slowdown
    from tests.helpers import CycleTarget

    recorded = RecordedPasses(CycleTarget())
    assert recorded.vocab_size == 64 and recorded.supports_trees is False
    prompt = [1, 2, 3, 4]
    recorded.verify_batch([(0, prompt, [5, 6]), (1, prompt, [5, 6])])  # both prompts: left out
    logits = recorded.verify_batch([(0, prompt, [5, 6, 7]), (1, prompt, [5])])
    assert [len(x) for x in logits] == [4, 2]  # the target's own answer, passed back
    recorded.verify_batch([(0, prompt, [5]), (2, prompt, [])])  # sequence 2's prompt: left out
    assert recorded.verify(0, prompt, [5, 6]).shape == (3, 64)
    recorded.release(0)  # a sequence 0 after it (a new decoder's) opens with its prompt
    recorded.verify_batch([(0, prompt, [5])])
    assert [(p.sequences, p.tokens, p.tree) for p in recorded.passes] == [
        (2, 6, False),
        (1, 3, False),
    ]
    doc = {"target": {"name": "t", "tree_pass": 1.5, "pass": {
        "batch": [1, 1, 2, 2], "tokens": [1, 9, 2, 18], "ms": [1.0, 2.0, 3.0, 5.0]}}}  # fmt: skip
    path = tmp_path / "target.json"
    path.write_text(json.dumps(doc))
    target = load_target(path)
    passes = [
        Pass(1, 9, False, 3e-3),  # 2 ms in the table
        Pass(1, 9, True, 4.5e-3),  # a tree of 8: 2 ms x 1.5
        Pass(2, 18, False, 1.0),  # another batch size: not this row's
    ]
    assert in_run_slowdown(passes, target, 1) == pytest.approx(7.5 / 5.0)
    assert in_run_slowdown(passes, target, 2) == pytest.approx(1000 / 5.0)
    assert in_run_slowdown(passes, target, 4) is None
