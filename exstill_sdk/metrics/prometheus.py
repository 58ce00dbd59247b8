"""Prometheus collectors: what a card, a decoder, the vLLM proposer's rows and a pool of cards
have counted, read when scraped (nothing is counted twice and the round's path pays nothing).

Counters end in ``_total``, times are in seconds, and every series carries a ``card`` label
(the card's URL; a pool's URL for what a decoder on a pool counted). The decoder's draft
counters take vLLM's names (``exstill_spec_decode_num_drafts_total`` is what vLLM exports as
``vllm:spec_decode_num_drafts``). docs/metrics.md lists every series.

Register a collector with ``prometheus_client.REGISTRY.register(...)`` (or any registry), and
serve it with ``prometheus_client.start_http_server`` or your server's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from exstill_sdk.metrics.histogram import Histogram

CARD_COUNTERS = {
    "frames": "Frames the card served.",
    "frames_dropped": "Frames the card dropped (bad CRC, length or version).",
    "rounds": "Rounds (COMMITs) the card served.",
    "drafts": "Drafts the card made.",
    "draft_tokens": "Tokens the card drafted.",
    "accepted_tokens": "Drafted tokens the host reported accepted.",
    "prefetch_hits": "COMMITs answered by a draft made ahead.",
    "prefetch_misses": "COMMITs whose draft was made after they came.",
    "prefetch_late": "COMMITs that came while the draft ahead was still being made.",
    "prefetch_outcome_hits": "Hits on a draft made ahead for another outcome than full acceptance.",
    "prefetch_outcome_partial": "Misses answered by finishing a draft begun ahead for that "
    "outcome.",
    "prefetch_outcomes_late": "COMMITs that came before the drafts ahead for other outcomes "
    "were done.",
    "prefetch_wasted_tokens": "Tokens drafted ahead for outcomes that did not happen.",
    "ahead_steps": "Batched steps of drafting ahead.",
    "ahead_step_streams": "Streams drafted in the steps of drafting ahead.",
    "outcome_passes": "Passes of a stream's outcome tree (drafting ahead for other outcomes).",
    "outcome_pass_width": "Outcomes drafted in the passes of the outcome trees.",
    "streams_opened": "Streams the card opened.",
    "images_set_aside": "Stored images the card would not serve at boot.",
    "admin_refused": "Requests refused for want of the admin key.",
}
"""The card's STATS counters (docs/protocol.md, "Telemetry"), each exported as
``exstill_card_<name>_total``."""


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _histogram(name: str, doc: str, card: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["card"])
    family.add_metric([card], histogram.cumulative(), sum_value=histogram.sum)
    return family


class CardCollector(Collector):
    """A card's telemetry: ``stats`` is ``Card.stats`` (a STATS request per scrape) or, inside
    the emulator, the runtime's own snapshot."""

    def __init__(self, stats: Callable[[], dict[str, int]], card: str) -> None:
        self.stats, self.card = stats, card

    def collect(self) -> Iterator[Metric]:
        return iter(card_metrics(self.stats(), self.card))


def card_metrics(stats: dict[str, int], card: str) -> list[Metric]:
    """STATS as Prometheus metrics (module docstring); a counter this SDK does not know is
    exported as ``exstill_card_stat{name=...}``."""
    on = {"card": card}
    out: list[Metric] = []
    errors = CounterMetricFamily(
        "exstill_card_errors",
        "Requests the card answered with an error, by code.",
        labels=["card", "code"],
    )
    by_accepted = CounterMetricFamily(
        "exstill_card_prefetch_hits_by_accepted",
        "Prefetch hits by the number of drafted tokens the host accepted.",
        labels=["card", "accepted"],
    )
    unknown = GaugeMetricFamily("exstill_card_stat", "A STATS counter.", labels=["card", "name"])
    for name, value in stats.items():
        if name in CARD_COUNTERS:
            out.append(_counter(f"exstill_card_{name}", CARD_COUNTERS[name], on, value))
        elif name.startswith("errors."):
            errors.add_metric([card, name[len("errors.") :]], value)
        elif name.startswith("prefetch_hits.accepted_"):
            by_accepted.add_metric([card, name[len("prefetch_hits.accepted_") :]], value)
        elif name == "ahead_step_us":
            out.append(
                _counter(
                    "exstill_card_drafting_ahead_seconds",
                    "Seconds the card spent drafting ahead while the host verified.",
                    on,
                    value / 1e6,
                )
            )
        elif name == "outcome_pass_us":
            out.append(
                _counter(
                    "exstill_card_outcome_drafting_seconds",
                    "Seconds the card spent drafting ahead for other outcomes.",
                    on,
                    value / 1e6,
                )
            )
        elif name == "streams_open":
            out.append(_gauge("exstill_card_streams_open", "Streams open now.", on, value))
        elif name == "uptime_ms":
            out.append(
                _gauge("exstill_card_uptime_seconds", "Seconds since boot.", on, value / 1e3)
            )
        else:
            unknown.add_metric([card, name], value)
    return [*out, errors, by_accepted, *([unknown] if unknown.samples else [])]


class DecoderCollector(Collector):
    """What a ``SpeculativeDecoder`` counted (its ``metrics``, streams and reconnects)."""

    def __init__(self, decoder: Any, card: str | None = None) -> None:
        self.decoder = decoder
        self.card = card or decoder.card.url

    def collect(self) -> Iterator[Metric]:
        d, on = self.decoder, {"card": self.card}
        m = d.metrics
        yield from _draft_counters(m, self.card)
        yield _counter("exstill_rounds", "Verification rounds.", on, m.rounds)
        yield _counter(
            "exstill_emitted_tokens", "Tokens the target accepted.", on, m.emitted_tokens
        )
        yield _counter(
            "exstill_prefetch_hits", "Drafts the card had made ahead.", on, m.prefetch_hits
        )
        yield _counter(
            "exstill_card_wait_seconds", "Seconds the host waited for the card.", on, m.card_wait_s
        )
        yield _counter("exstill_verify_seconds", "Seconds of verification.", on, m.verify_s)
        yield from _stream_counters(d.streams_opened, d.streams_refused, d.reconnects, on)
        yield _histogram(
            "exstill_round_trip_seconds", "Each round's card half.", self.card, d.round_trips
        )


def _draft_counters(m: Any, card: str) -> Iterable[Metric]:
    """Drafts, drafted and accepted tokens, per position too: vLLM's spec-decode names."""
    on = {"card": card}
    yield _counter("exstill_spec_decode_num_drafts", "Drafts verified.", on, m.num_drafts)
    yield _counter(
        "exstill_spec_decode_num_draft_tokens", "Drafted tokens verified.", on, m.num_draft_tokens
    )
    yield _counter(
        "exstill_spec_decode_num_accepted_tokens",
        "Drafted tokens accepted.",
        on,
        m.num_accepted_tokens,
    )
    per_pos = CounterMetricFamily(
        "exstill_spec_decode_num_accepted_tokens_per_pos",
        "Drafted tokens accepted, by position in the draft.",
        labels=["card", "position"],
    )
    for position, n in enumerate(m.num_accepted_tokens_per_pos):
        per_pos.add_metric([card, str(position)], n)
    yield per_pos


def _stream_counters(
    opened: int, refused: int, reconnects: int, on: dict[str, str]
) -> Iterable[Metric]:
    yield _counter("exstill_streams_opened", "Card streams opened.", on, opened)
    yield _counter("exstill_streams_refused", "Card streams refused (card full).", on, refused)
    yield _counter("exstill_reconnects", "Times a lost card was reconnected.", on, reconnects)


class RowsCollector(Collector):
    """What the vLLM proposer's ``RowStreams`` counted."""

    def __init__(self, rows: Any, card: str | None = None) -> None:
        self.rows = rows
        self.card = card or rows.card.url

    def collect(self) -> Iterator[Metric]:
        st, on = self.rows.stats, {"card": self.card}
        yield _counter("exstill_rows_commits", "Rows kept in step with one COMMIT.", on, st.commits)
        yield _counter("exstill_rows_prefills", "Rows that needed a prefill.", on, st.prefills)
        yield _counter(
            "exstill_prefetch_hits", "Drafts the card had made ahead.", on, st.prefetch_hits
        )
        yield _counter(
            "exstill_rows_without_stream",
            "Row-steps without a draft: no free stream.",
            on,
            st.no_stream,
        )
        yield _counter(
            "exstill_rows_errors", "Rows whose stream the card refused or lost.", on, st.errors
        )
        yield _counter("exstill_streams_closed", "Card streams closed.", on, st.closed)
        yield from _stream_counters(st.opened, 0, st.reconnects, on)
        yield _histogram(
            "exstill_round_trip_seconds",
            "Each step's card half.",
            self.card,
            self.rows.round_trips,
        )


class PoolCollector(Collector):
    """A pool's placement: each card up or set aside, its streams and how often it was lost."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "exstill_pool_card_up", "1 while the card is in the pool.", labels=["card"]
        )
        placed = CounterMetricFamily(
            "exstill_pool_streams_placed", "Streams placed on the card.", labels=["card"]
        )
        lost = CounterMetricFamily(
            "exstill_pool_card_lost", "Times the card was lost.", labels=["card"]
        )
        open_now = GaugeMetricFamily(
            "exstill_pool_streams_open", "Streams the pool has open on the card.", labels=["card"]
        )
        for member in self.pool.members:
            up.add_metric([member.url], float(member.card is not None))
            placed.add_metric([member.url], member.placed)
            lost.add_metric([member.url], member.lost)
            open_now.add_metric([member.url], sum(not s.closed for s in member.streams))
        yield from (up, placed, lost, open_now)
