"""exstill-bench soak for a minute, as CI runs it: users come and go on two emulated cards
(each an exstill-emu process) while one is killed and restarted."""

from __future__ import annotations

import json
import subprocess

from .helpers import script


def test_a_minute_of_users_with_cards_restarting_loses_nothing() -> None:
    run = subprocess.run(
        [
            script("exstill-bench"),
            "soak",
            "--minutes",
            "1",
            "--users",
            "8",
            "--cards",
            "2",
            "--restart-every",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    print(json.dumps({k: v for k, v in r.items() if k != "samples"}))
    assert r["card_restarts"] >= 1 and r["decoder_reconnects"] >= 1
    assert r["greedy_checked"] > 0 and r["sampled"] > 0
    assert r["wrong_tokens"] == 0 and r["failed_requests"] == 0, r["errors"]
    assert r["streams_open_end"] == 0 and r["cards_up_end"] == 2  # no stream leaked
    assert r["fds"]["end"] <= r["fds"]["start"]  # no socket leaked (every card up at both)
    assert r["rss_mb"]["growth"] < 0.10
