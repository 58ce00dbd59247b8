"""Metrics an operator scrapes: Prometheus collectors for a card's telemetry, a decoder, the
vLLM proposer's rows and a pool of cards (prometheus.py), and the round-trip histogram the
decoder and the proposer keep (histogram.py)."""

from exstill_sdk.metrics.histogram import Histogram

__all__ = ["Histogram"]
