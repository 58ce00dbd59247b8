"""The measured card profile's parts that are arithmetic on measurements."""

from __future__ import annotations

from exstill_sdk.plan.measure.profile import ahead_line, host_line


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


def test_host_line_from_runs() -> None:
    assert host_line([(1, 100.0), (3, 140.0)]) == {"us_per_round": 80.0, "us_per_sequence": 20.0}


def test_table_ms_interpolates_one_batchs_passes_and_retime_replaces_them() -> None:
    from exstill_sdk.plan.measure.profile import table_ms

    rows = {"batch": [1, 1, 1, 4, 4], "tokens": [1, 5, 9, 4, 36], "ms": [2.0, 3.0, 5.0, 6.0, 9.0]}
    doc = {"target": {"pass": rows}}
    assert table_ms(doc, 1, 7) == 4.0  # between 5 tokens (3 ms) and 9 (5 ms)
    assert table_ms(doc, 4, 36) == 9.0
    assert table_ms(doc, 1, 1) == 2.0
