"""Collectors' values copied into prometheus_client's own metric objects, for another
process's ``/metrics``.

prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before it is imported)
makes every Counter, Gauge and Histogram object write its values to files in that directory,
and a ``MultiProcessCollector`` in the serving process reads them all. vLLM serves its
``/metrics`` that way whenever the variable is set (``vllm.v1.metrics.prometheus``), while the
Exstill proposer runs in an engine worker process. Custom collectors (prometheus.py) are
read only in their own process, so ``MultiprocessMirror`` copies what they collect into such
objects: counters by their increase since the last copy, gauges as they are, histograms by the
increase of each bucket and of the sum. ``start`` copies every ``every_s`` seconds from a
thread of its own, so the round's path pays nothing; ``stop`` makes a last copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.registry import Collector

ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """Whether prometheus_client writes this process's metrics for another to serve."""
    return bool(os.environ.get(ENV))


class MultiprocessMirror:
    def __init__(self, collectors: Iterable[Collector], every_s: float = 1.0) -> None:
        self.collectors = list(collectors)
        self.every_s = every_s
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """Copy the collectors' values now."""
        with self._lock:
            for collector in self.collectors:
                for family in collector.collect():
                    self._copy(family)

    def start(self) -> None:
        """Copy every ``every_s`` seconds until ``stop``."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="exstill-metrics-mirror", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.refresh()

    def stop(self) -> None:
        """Stop copying, after a last copy."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self.refresh()

    def _metric(self, family: Any, labels: tuple[str, ...], bounds: list[float]) -> Any:
        metric = self._metrics.get(family.name)
        if metric is None:
            if family.type == "counter":
                metric = Counter(family.name, family.documentation, labels, registry=None)
            elif family.type == "gauge":
                metric = Gauge(
                    family.name,
                    family.documentation,
                    labels,
                    registry=None,
                    multiprocess_mode="livesum",
                )
            else:
                metric = PromHistogram(
                    family.name, family.documentation, labels, registry=None, buckets=bounds
                )
            self._metrics[family.name] = metric
        return metric

    def _copy(self, family: Any) -> None:
        if family.type not in ("counter", "gauge", "histogram"):
            return
        by_labels: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for sample in family.samples:
            own = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            entry = by_labels.setdefault(own, {"buckets": []})
            if sample.name.endswith("_bucket"):
                entry["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                entry["sum"] = sample.value
            elif sample.name.endswith(("_created", "_count")):
                continue
            else:
                entry["value"] = sample.value
        for own, entry in by_labels.items():
            names = tuple(k for k, _ in own)
            values = tuple(v for _, v in own)
            buckets = sorted(entry["buckets"])
            metric = self._metric(family, names, [b for b, _ in buckets])
            child = metric.labels(*values) if names else metric
            key = (family.name, values)
            if family.type == "gauge":
                child.set(entry["value"])
            elif family.type == "counter":
                grown = entry["value"] - self._last.get(key, 0.0)
                if grown > 0:
                    child.inc(grown)
                self._last[key] = entry["value"]
            else:
                counts = [c for _, c in buckets]  # cumulative, as the exposition has them
                before = self._last.get(key) or ([0.0] * len(counts), 0.0)
                grown_up_to = [c - b for c, b in zip(counts, before[0], strict=True)]
                # prometheus_client has no public way to add a bucket's count: its children
                # keep one value per bucket (_buckets, not cumulative) and the sum (_sum)
                below = 0.0
                for value, up_to in zip(child._buckets, grown_up_to, strict=True):
                    if up_to - below > 0:
                        value.inc(up_to - below)
                    below = up_to
                sum_grown = entry.get("sum", 0.0) - before[1]
                if sum_grown > 0:
                    child._sum.inc(sum_grown)
                self._last[key] = (counts, entry.get("sum", 0.0))
