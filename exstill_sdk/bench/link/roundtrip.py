"""Host cost of one verification round: a COMMIT out, the next draft back.

The stream drafts with the lookup engine on a repeating 1,000-token context and the "target"
accepts every draft, so each round carries a full K-token draft. For tcp:// URLs, the same run
also times a plain Python socket ping-pong with the same byte counts against a trivial echo
server in another process (the floor any protocol on that link pays), interleaving the two in
blocks so that machine noise hits both alike. With ``streams`` > 1 it also times a step of one
round on each of that many streams, their COMMITs sent one after another or all at once.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from exstill_sdk.card import DEFAULT_TIMEOUT, Card, open_card
from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.harness.placement import listening_pid, placed
from exstill_sdk.protocol.constants import FRAME_OVERHEAD
from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.protocol.framing import encode_stream_frame
from exstill_sdk.protocol.messages import COMMIT_REQUEST
from exstill_sdk.transport.base import Transport, open_transport
from exstill_sdk.transport.bytestream import ByteStreamTransport

BLOCK = 250


class _CountingTransport(Transport):
    """Tallies the bytes each frame takes on the link, framing included."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.url = inner.url
        self.framed = isinstance(inner, ByteStreamTransport)
        self.bytes = 0

    @classmethod
    def from_url(cls, url: Any, timeout: float) -> Transport:
        raise NotImplementedError

    def _size(self, frame: bytes) -> int:
        return len(encode_stream_frame(frame)) if self.framed else len(frame)

    def send_frame(self, frame: bytes) -> None:
        self.bytes += self._size(frame)
        self.inner.send_frame(frame)

    def recv_frame(self, deadline: float) -> bytes:
        frame = self.inner.recv_frame(deadline)
        self.bytes += self._size(frame)
        return frame

    def close(self) -> None:
        self.inner.close()


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class _Rounds:
    """A stream whose every round accepts the whole draft of a repeating text."""

    def __init__(self, card: Card, k: int, context: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.period = [rng.randrange(1, 32000) for _ in range(97)]
        self.k = k
        self.context = context
        self.stream = card.open_stream("lookup", max_k=max(k, 1))
        self.stream.prefill([self.period[i % 97] for i in range(context)])
        self.draft = self.stream.draft(k)

    def bonus(self) -> int:
        return self.period[(self.stream.length + len(self.draft.tokens)) % 97]

    def reset_if_long(self) -> None:
        if self.stream.length > self.context + 4 * BLOCK * (self.k + 1):
            self.stream.rollback(self.context)
            self.draft = self.stream.draft(self.k)

    def timed(self, n: int) -> list[float]:
        out = []
        stream, k, period = self.stream, self.k, self.period
        clock = time.perf_counter
        draft = self.draft
        for _ in range(n):
            accepted = len(draft.tokens)
            verdict = Verdict(accepted, period[(stream.length + accepted) % 97])
            t0 = clock()
            draft = stream.commit(verdict, k)
            out.append(clock() - t0)
        self.draft = draft
        return out


def _start_echo(
    request_bytes: int, reply_bytes: int, cpus: set[int] | None
) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "exstill_sdk.bench.link.echo", str(request_bytes), str(reply_bytes)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _raw_pingpong(sock: socket.socket, request: bytes, reply_bytes: int, n: int) -> list[float]:
    out = []
    clock = time.perf_counter
    buf = bytearray(65536)
    for _ in range(n):
        t0 = clock()
        sock.sendall(request)
        got = 0
        while got < reply_bytes:
            got += sock.recv_into(buf)
        out.append(clock() - t0)
    return out


def _measure(
    rounds_state: _Rounds,
    rounds: int,
    with_raw: bool,
    request_bytes: int,
    reply_bytes: int,
    echo_cpus: set[int] | None,
) -> tuple[list[float], list[float]]:
    """Card rounds, and raw ping-pongs when asked, interleaved in blocks."""
    echo = sock = None
    if with_raw:
        echo, port = _start_echo(request_bytes, reply_bytes, echo_cpus)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = b"\x01" * request_bytes
    card_times: list[float] = []
    raw_times: list[float] = []
    try:
        if sock is not None:  # warm-up
            _raw_pingpong(sock, request, reply_bytes, 200)
        while len(card_times) < rounds:
            n = min(BLOCK, rounds - len(card_times))
            card_times += rounds_state.timed(n)
            rounds_state.reset_if_long()
            if sock is not None:
                raw_times += _raw_pingpong(sock, request, reply_bytes, n)
    finally:
        if sock is not None:
            sock.close()
        if echo is not None:
            echo.kill()
            echo.wait()
    return card_times, raw_times


def _steps(states: list[_Rounds], n: int, pipelined: bool) -> list[float]:
    """Time n steps of one round on every stream: COMMITs one after another, or all sent
    before any reply is read (what RowStreams does for a serving engine's batch)."""
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        if pipelined:
            sent = []
            for st in states:
                verdict = Verdict(len(st.draft.tokens), st.bonus())
                sent.append((st, st.stream.send_commit(verdict, st.k), verdict))
            for st, rid, verdict in sent:
                st.draft = st.stream.receive_commit(rid, verdict)
        else:
            for st in states:
                st.draft = st.stream.commit(Verdict(len(st.draft.tokens), st.bonus()), st.k)
        out.append(clock() - t0)
    for st in states:
        st.reset_if_long()
    return out


def many_streams(card: Card, k: int, rounds: int, context: int, streams: int) -> dict[str, Any]:
    """A step of one round on each of ``streams`` streams, sequential vs pipelined, interleaved
    in blocks."""
    states = [_Rounds(card, k, context, seed) for seed in range(streams)]
    sequential: list[float] = []
    pipelined: list[float] = []
    _steps(states, 50, True)  # warm-up
    while len(sequential) < rounds:
        n = min(BLOCK // streams + 1, rounds - len(sequential))
        sequential += _steps(states, n, False)
        pipelined += _steps(states, n, True)
    for st in states:
        st.stream.close()
    seq_p50 = _percentile(sorted(sequential), 0.5) * 1e6
    pipe_p50 = _percentile(sorted(pipelined), 0.5) * 1e6
    return {
        "streams": streams,
        "step_sequential_p50_us": round(seq_p50, 2),
        "step_pipelined_p50_us": round(pipe_p50, 2),
        "pipelined_speedup": round(seq_p50 / pipe_p50, 2),
    }


def run(
    url: str,
    k: int = 6,
    rounds: int = 10000,
    context: int = 1000,
    placement: str = "cross-core",
    streams: int = 1,
) -> dict[str, Any]:
    if not 1 <= k <= 255 or rounds < 1 or context < 200 or not 1 <= streams <= 255:
        raise InvalidArgumentError(
            "need 1 <= k <= 255, rounds >= 1, context >= 200, 1 <= streams <= 255"
        )
    # Bytes on the link per round, framing included: 100 untimed rounds on a connection of
    # their own, whose link counts them (the timed rounds' link counts nothing).
    counter = _CountingTransport(open_transport(url, DEFAULT_TIMEOUT))
    with Card(counter) as counted:
        counted_rounds = _Rounds(counted, k, context)
        counter.bytes = 0
        counted_rounds.timed(100)
        bytes_per_round = counter.bytes / 100
        counted_rounds.stream.close()
    card = open_card(url)
    try:
        rounds_state = _Rounds(card, k, context)
        commit_frame = FRAME_OVERHEAD + COMMIT_REQUEST.size
        request_bytes = (
            len(encode_stream_frame(bytes(commit_frame))) if counter.framed else commit_frame
        )
        reply_bytes = round(bytes_per_round) - request_bytes
        rounds_state.reset_if_long()

        server_pid = None
        if url.startswith("tcp://"):
            port = urlsplit(url).port
            server_pid = listening_pid(port) if port else None
        rounds_state.timed(200)  # warm-up
        before = card.stats()
        with placed(placement if url.startswith("tcp://") else "none", server_pid) as (
            echo_cpus,
            placement_used,
        ):
            card_times, raw_times = _measure(
                rounds_state,
                rounds,
                url.startswith("tcp://"),
                request_bytes,
                reply_bytes,
                echo_cpus,
            )
            after = card.stats()
            rounds_state.stream.close()
            several = (
                many_streams(card, k, max(1, rounds // streams), context, streams)
                if streams > 1
                else {}
            )
    finally:
        card.close()
    card_times.sort()
    result: dict[str, Any] = {
        "url": url,
        "k": k,
        "rounds": rounds,
        "context": context,
        "p50_us": round(_percentile(card_times, 0.50) * 1e6, 2),
        "p99_us": round(_percentile(card_times, 0.99) * 1e6, 2),
        "mean_us": round(sum(card_times) / len(card_times) * 1e6, 2),
        "bytes_per_round": bytes_per_round,
        "request_bytes": request_bytes,
        "reply_bytes": reply_bytes,
        "framing": "cobs" if counter.framed else "whole frames",
        "placement": placement_used,
        # Counted over the timed rounds only (the card's counters are card-wide).
        "prefetch_hits": after["prefetch_hits"] - before["prefetch_hits"],
        "prefetch_late": after["prefetch_late"] - before["prefetch_late"],
    }
    if raw_times:
        raw_times.sort()
        raw_p50 = _percentile(raw_times, 0.50) * 1e6
        result["raw_socket_p50_us"] = round(raw_p50, 2)
        result["raw_socket_p99_us"] = round(_percentile(raw_times, 0.99) * 1e6, 2)
        result["ratio_to_raw_p50"] = round(result["p50_us"] / raw_p50, 3)
    result.update(several)
    return result
