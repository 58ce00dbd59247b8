"""The proposer's way into vLLM's own /metrics: a worker process with PROMETHEUS_MULTIPROC_DIR
set copies its collectors into prometheus_client's multiprocess files (MultiprocessMirror), and
the serving process's MultiProcessCollector (what vLLM's /metrics uses) reads values equal to
the worker's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

WORKER = textwrap.dedent(
    """
    import json, sys
    from exstill_sdk import open_card
    from exstill_sdk.metrics.multiprocess import MultiprocessMirror, multiprocess_mode
    from exstill_sdk.metrics.prometheus import DecoderCollector
    from exstill_sdk.speculative import SpeculativeDecoder
    from tests.helpers import CycleTarget, cycle_reference

    assert multiprocess_mode()
    with open_card("emu://") as card:
        decoder = SpeculativeDecoder(card, CycleTarget(), engine="lookup", k=4)
        mirror = MultiprocessMirror([DecoderCollector(decoder)], every_s=0.01)
        mirror.start()  # copies from its own thread while the decoder runs
        prompts = [[5 + i, 6, 7, 5 + i, 6, 7] for i in range(4)]
        for n in (20, 33):  # two copies: the second adds only what grew
            results = decoder.generate_batch(prompts, n, stop_token_ids=[])
            assert [r.tokens for r in results] == [cycle_reference(p, n) for p in prompts]
            mirror.refresh()
        mirror.stop()  # a last copy
        own = [
            [s.name, dict(s.labels), s.value]
            for family in DecoderCollector(decoder).collect()
            for s in family.samples
            if not s.name.endswith("_created")
        ]
    json.dump(own, sys.stdout)
    """
)


def test_a_workers_metrics_reach_the_serving_process(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", WORKER], env=env, cwd=root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    worker = {(n, tuple(sorted(labels.items()))): v for n, labels, v in json.loads(out.stdout)}
    assert any(v > 0 for (n, _), v in worker.items() if n.endswith("num_drafts_total"))

    registry = CollectorRegistry()  # what vLLM's /metrics serves with the variable set
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    served = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert worker  # every series the worker's collector has, with its value
    for key, value in worker.items():
        assert abs(served[key] - value) <= 1e-9 * max(1.0, abs(value)), key
