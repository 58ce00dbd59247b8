"""Metrics scraped over real HTTP and parsed with prometheus_client's own parser: the card's
(exstill-emu --metrics-listen) equal its STATS, the host's equal the decoder's own counts."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from exstill_sdk import CardPool
from exstill_sdk.metrics import Histogram
from exstill_sdk.metrics.prometheus import (
    CARD_COUNTERS,
    DecoderCollector,
    PoolCollector,
    RowsCollector,
)
from exstill_sdk.speculative import SpeculativeDecoder

from ..cli.helpers import start_emu
from ..helpers import CycleTarget, cycle_reference


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_card_and_host_metrics_equal_stats_and_the_decoders_counts() -> None:
    proc, url = start_emu("--cards", "2", "--metrics-listen", "127.0.0.1:0")
    try:
        assert proc.stderr is not None
        card_metrics = proc.stderr.readline().split()[-1]
        assert card_metrics.startswith("http://127.0.0.1:") and card_metrics.endswith("/metrics")
        prompts = [[5 + i, 6, 7, 5 + i, 6, 7] for i in range(5)]
        with CardPool(url.split(",")) as pool:
            decoder = SpeculativeDecoder(pool, CycleTarget(), engine="lookup", k=4)
            results = decoder.generate_batch(prompts, 30, stop_token_ids=[])
            assert [r.tokens for r in results] == [cycle_reference(p, 30) for p in prompts]
            stats = pool.member_stats()
            card_side = scrape(card_metrics)
            registry = CollectorRegistry()
            registry.register(DecoderCollector(decoder))
            registry.register(PoolCollector(pool))
            http, thread = start_http_server(0, "127.0.0.1", registry=registry)
            try:
                host_side = scrape(f"http://127.0.0.1:{http.server_port}/metrics")
            finally:
                http.shutdown()
                thread.join(5)
            placed = [m.placed for m in pool.members]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    # the card's: every STATS counter of each card, under its name, labelled by the card
    for card, counters in stats.items():
        on = (("card", card),)
        assert counters["rounds"] > 0
        for name in CARD_COUNTERS:
            assert card_side[(f"exstill_card_{name}_total", on)] == counters[name], name
        assert card_side[("exstill_card_streams_open", on)] == counters["streams_open"] == 0
        assert card_side[("exstill_card_drafting_ahead_seconds_total", on)] == (
            counters["ahead_step_us"] / 1e6
        )
        assert card_side[("exstill_card_outcome_drafting_seconds_total", on)] == (
            counters["outcome_pass_us"] / 1e6
        )
        assert (
            card_side[("exstill_card_errors_total", (*on, ("code", "bad_handle")))]
            == (counters["errors.bad_handle"])
        )
    # the host's: the decoder's metrics under vLLM's spec-decode names, and the pool's placement
    m, on = decoder.metrics, (("card", pool.url),)
    assert host_side[("exstill_spec_decode_num_drafts_total", on)] == m.num_drafts > 0
    assert host_side[("exstill_spec_decode_num_draft_tokens_total", on)] == m.num_draft_tokens
    assert host_side[("exstill_spec_decode_num_accepted_tokens_total", on)] == (
        m.num_accepted_tokens
    )
    for position, n in enumerate(m.num_accepted_tokens_per_pos):
        key = (
            "exstill_spec_decode_num_accepted_tokens_per_pos_total",
            (*on, ("position", str(position))),
        )
        assert host_side[key] == n
    assert host_side[("exstill_rounds_total", on)] == m.rounds
    assert host_side[("exstill_emitted_tokens_total", on)] == m.emitted_tokens == 5 * 30
    assert host_side[("exstill_streams_opened_total", on)] == decoder.streams_opened == 5
    assert host_side[("exstill_round_trip_seconds_count", on)] == decoder.round_trips.count > 0
    assert host_side[("exstill_round_trip_seconds_sum", on)] == decoder.round_trips.sum
    for member, n in zip(pool.members, placed, strict=True):
        assert host_side[("exstill_pool_streams_placed_total", (("card", member.url),))] == n
        assert host_side[("exstill_pool_card_up", (("card", member.url),))] == 1.0


def test_histogram_buckets_are_cumulative_and_end_at_inf() -> None:
    h = Histogram((1e-3, 1e-2))
    for seconds in (5e-4, 1e-3, 2e-3, 1.0):
        h.observe(seconds)
    assert h.cumulative() == [("0.001", 2.0), ("0.01", 3.0), ("+Inf", 4.0)]
    assert h.count == 4 and abs(h.sum - 1.0035) < 1e-12


def test_rows_collector_counts_what_row_streams_counted() -> None:
    import numpy as np

    from exstill_sdk.adapters.rows import RowStreams
    from exstill_sdk.card import open_card

    with open_card("emu://") as card:
        rows = RowStreams(card, engine="lookup")
        tokens = np.array([[1, 2, 3, 1, 2, 3, 1, 2]])
        rows.propose([[2]], np.array([8]), tokens, 3)
        registry = CollectorRegistry()
        registry.register(RowsCollector(rows))
        samples = {
            s.name: s.value
            for family in registry.collect()
            for s in family.samples
            if s.labels.get("card") == "emu://"
        }
        assert samples["exstill_rows_prefills_total"] == rows.stats.prefills == 1
        assert samples["exstill_streams_opened_total"] == rows.stats.opened == 1
        assert samples["exstill_round_trip_seconds_count"] == rows.round_trips.count == 1
        rows.close()
