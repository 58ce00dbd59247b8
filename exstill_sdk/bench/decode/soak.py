"""exstill-bench soak: users come and go on a pool of emulated cards for minutes on end, while a
card is killed and restarted; what leaks or breaks shows.

- Each card is an ``exstill-emu`` process of its own; one is killed (SIGKILL) every
  ``restart_every`` seconds (jittered by a fifth either way) and started again on its port two
  seconds later. The pool sets it aside, reopens its streams on the other cards, and takes it
  back when it answers.
- Each of ``users`` threads sends request after request: a random prompt (4 to 64 tokens), a
  random answer length (8 to ``max_new_tokens``), greedy or sampled (three in ten), each through
  a ``SpeculativeDecoder`` of its own (K = 4) on the one shared ``CardPool``.
- The target is ``LoopTarget``: deterministic and cheap (a fixed random row of logits chosen by
  the last two tokens), so that the host's and the cards' machinery, not a model, is what runs;
  its greedy text falls into loops that prompt lookup drafts. Every greedy answer is compared
  with the target's own greedy decoding.
- Every ``sample_s`` seconds: this process's RSS and open file descriptors, and the streams the
  cards have open (beside the requests in flight). The RSS after warm-up (a tenth of the run, at
  least 30 s) is the baseline the end is compared with; the descriptors (a socket and a pipe a
  card up) at the start, when every card is up, as at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exstill_sdk.errors import ExstillError
from exstill_sdk.speculative.adapter import TargetAdapter

VOCAB = 128
ROWS = 1024
START_TIMEOUT_S = 60.0
DOWN_S = 2.0
"""How long a killed card stays down before it is started again."""
SAMPLED_SHARE = 0.3
K = 4
"""Every request drafts 4 tokens a round: adaptive K would rightly draft nothing for a target
this cheap, and the soak is of the card's streams and rounds."""


class LoopTarget(TargetAdapter):
    """A stateless, thread-safe target: the logits after tokens (a, b) are row
    ``(31 a + b) mod 1024`` of a fixed random table (the first token alone: row ``b``)."""

    vocab_size = VOCAB

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)

    def _row(self, seq: Sequence[int], i: int) -> int:
        return (31 * int(seq[i - 1]) + int(seq[i])) % ROWS if i else int(seq[i]) % ROWS

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        seq = [*context, *draft]
        return self.table[[self._row(seq, i) for i in range(len(context) - 1, len(seq))]]

    def rollback(self, seq_id: int, length: int) -> None:
        pass

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """The target alone, greedy: what every greedy answer must be."""
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.table[self._row(seq, len(seq) - 1)].argmax()))
        return seq[len(prompt) :]


class CardProcess:
    """An ``exstill-emu`` process that can be killed and started again on its port."""

    def __init__(self, streams: int, context: int) -> None:
        self.args = ["--streams", str(streams), "--context", str(context)]
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        command = [sys.executable, "-m", "exstill_sdk.cli.emu", *self.args]
        command += ["--listen", f"tcp://127.0.0.1:{self.port}"]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        url = self.proc.stdout.readline().strip()
        if not url.startswith("tcp://"):
            self.kill()
            raise ExstillError(f"exstill-emu did not start (it printed {url!r})")
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(START_TIMEOUT_S)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


@dataclass
class Tally:
    """What the users saw, counted under one lock."""

    requests: int = 0
    greedy_checked: int = 0
    sampled: int = 0
    tokens: int = 0
    wrong_tokens: int = 0
    wrong_requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    reconnects: int = 0
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _user(
    index: int,
    pool: Any,
    target: LoopTarget,
    deadline: float,
    max_new_tokens: int,
    tally: Tally,
) -> None:
    from exstill_sdk.speculative import SamplingParams, SpeculativeDecoder

    rng = random.Random(index)
    while time.monotonic() < deadline:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 64))]
        n = rng.randint(8, max_new_tokens)
        sampled = rng.random() < SAMPLED_SHARE
        sampling = SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30)) if sampled else None
        with tally.lock:
            tally.in_flight += 1
        try:
            decoder = SpeculativeDecoder(pool, target, engine="lookup", sampling=sampling, k=K)
            tokens = decoder.generate(prompt, n, stop_token_ids=[]).tokens
        except Exception as exc:  # a failed request is what the soak counts, whatever it is
            with tally.lock:
                tally.failed += 1
                tally.in_flight -= 1
                if len(tally.errors) < 5:
                    tally.errors.append(f"{type(exc).__name__}: {exc}")
            continue
        expected = target.greedy(prompt, n)
        wrong = abs(len(tokens) - n)
        if not sampled:
            wrong += sum(a != b for a, b in zip(tokens, expected, strict=False))
        with tally.lock:
            tally.in_flight -= 1
            tally.requests += 1
            tally.tokens += len(tokens)
            tally.reconnects += decoder.reconnects
            tally.sampled += sampled
            tally.greedy_checked += not sampled
            tally.wrong_tokens += wrong
            tally.wrong_requests += bool(wrong)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(
    *,
    minutes: float = 30.0,
    users: int = 24,
    cards: int = 2,
    streams: int = 12,
    restart_every: float = 300.0,
    max_new_tokens: int = 200,
    sample_s: float = 5.0,
    progress: bool = False,
) -> dict[str, Any]:
    from exstill_sdk.pool import CardPool

    seconds = minutes * 60
    warm_up = max(30.0, seconds / 10)
    target = LoopTarget()
    processes = [CardProcess(streams, 4096) for _ in range(cards)]
    samples: list[dict[str, float]] = []
    restarts = 0
    tally = Tally()
    try:
        with CardPool([p.url for p in processes], rejoin_s=1.0) as pool:
            started = time.monotonic()
            deadline = started + seconds
            threads = [
                threading.Thread(
                    target=_user,
                    args=(i, pool, target, deadline, max_new_tokens, tally),
                    name=f"soak-user-{i}",
                    daemon=True,
                )
                for i in range(users)
            ]
            for thread in threads:
                thread.start()
            chaos = random.Random(0)
            next_kill = started + restart_every * chaos.uniform(0.8, 1.2)
            next_sample = started
            while time.monotonic() < deadline:
                now = time.monotonic()
                if now >= next_sample:
                    samples.append(_sample(pool, tally, now - started))
                    next_sample += sample_s
                    if progress:
                        s = samples[-1]
                        print(
                            f"{s['t']:7.0f} s  requests {tally.requests}  failed {tally.failed}"
                            f"  wrong {tally.wrong_tokens}  rss {s['rss_mb']:.1f} MB  fds "
                            f"{s['fds']:.0f}  streams {s['streams_open']:.0f}  cards up "
                            f"{s['cards_up']:.0f}  restarts {restarts}",
                            file=sys.stderr,
                            flush=True,
                        )
                if now >= next_kill:
                    victim = processes[chaos.randrange(cards)]
                    victim.kill()
                    time.sleep(DOWN_S)
                    victim.start()
                    restarts += 1
                    next_kill = time.monotonic() + restart_every * chaos.uniform(0.8, 1.2)
                time.sleep(min(0.2, max(0.0, min(next_sample, next_kill) - time.monotonic())))
            for thread in threads:
                thread.join()
            pool.rejoin(force=True)
            end = _sample(pool, tally, time.monotonic() - started)
            elapsed = time.monotonic() - started
    finally:
        for p in processes:
            p.kill()
    warm = [s for s in samples if s["t"] >= warm_up] or samples[-1:]
    base_rss, base_fds = warm[0]["rss_mb"], warm[0]["fds"]
    return {
        "minutes": minutes,
        "users": users,
        "cards": cards,
        "streams_per_card": streams,
        "restart_every_s": restart_every,
        "seconds": round(elapsed, 1),
        "requests": tally.requests,
        "greedy_checked": tally.greedy_checked,
        "sampled": tally.sampled,
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / elapsed, 1),
        "wrong_tokens": tally.wrong_tokens,
        "wrong_requests": tally.wrong_requests,
        "failed_requests": tally.failed,
        "errors": tally.errors,
        "card_restarts": restarts,
        "decoder_reconnects": tally.reconnects,
        "rss_mb": {
            "after_warm_up": round(base_rss, 1),
            "end": round(end["rss_mb"], 1),
            "max_after_warm_up": round(max(s["rss_mb"] for s in warm), 1),
            "median_after_warm_up": round(statistics.median(s["rss_mb"] for s in warm), 1),
            "growth": round(end["rss_mb"] / base_rss - 1, 4),
        },
        # descriptors follow the cards up (a socket and a pipe each): start and end have all
        "fds": {
            "start": samples[0]["fds"],
            "after_warm_up": base_fds,
            "end": end["fds"],
            "max": max(s["fds"] for s in samples),
        },
        "streams_open_end": end["streams_open"],
        "cards_up_end": end["cards_up"],
        "samples": samples,
    }


def _sample(pool: Any, tally: Tally, t: float) -> dict[str, float]:
    """RSS, descriptors, the streams the cards up have open, and the requests in flight."""
    streams = 0
    for member in pool.up:
        with contextlib.suppress(ExstillError):  # going down: the next sample sees it aside
            streams += member.card.stats()["streams_open"]
    return {
        "t": round(t, 1),
        "rss_mb": round(_rss_mb(), 2),
        "fds": float(_fds()),
        "streams_open": float(streams),
        "in_flight": float(tally.in_flight),
        "cards_up": float(len(pool.up)),
    }


def table(result: dict[str, Any]) -> str:
    rss, fds = result["rss_mb"], result["fds"]
    lines = [
        f"soak: {result['users']} users on {result['cards']} cards of "
        f"{result['streams_per_card']} streams, {result['seconds']:.0f} s, a card restarted "
        f"{result['card_restarts']} times",
        f"  requests {result['requests']} ({result['greedy_checked']} greedy checked, "
        f"{result['sampled']} sampled), {result['tokens']} tokens, "
        f"{result['tokens_per_s']} tokens/s",
        f"  wrong tokens {result['wrong_tokens']}, failed requests {result['failed_requests']}, "
        f"decoder reconnects {result['decoder_reconnects']}",
        f"  RSS {rss['after_warm_up']} MB after warm-up, {rss['end']} MB at the end "
        f"({rss['growth'] * 100:+.1f}%), max {rss['max_after_warm_up']} MB",
        f"  open files {fds['start']:.0f} at the start, {fds['end']:.0f} at the end (every card "
        f"up at both); "
        f"card streams open at the end {result['streams_open_end']:.0f}, cards up "
        f"{result['cards_up_end']:.0f}",
    ]
    lines += [f"  error: {e}" for e in result["errors"]]
    return "\n".join(lines)
