"""The serve loop every link shares (firmware/emulator/link.py): whole, checked frames only, and
the replies of one read written together."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import HostLink, PtyCardServer
from exstill_firmware.engines import LookupEngine
from exstill_firmware.engines.base import EngineState, Proposal

from exstill_sdk import Card, Verdict, open_card
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import RESPONSE_BIT, ModelKind, Opcode
from exstill_sdk.protocol.frame import decode_frame, encode_frame
from exstill_sdk.protocol.framing import Deframer, encode_stream_frame
from exstill_sdk.transport.emu import EmuTransport

from ..helpers import served


@pytest.fixture
def pty_card() -> Iterator[PtyCardServer]:
    runtime = CardRuntime(4, 1024, background_prefetch=False)
    server = PtyCardServer(runtime)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(5)
    runtime.shutdown()


def test_line_noise_carrying_the_hello_opcode_drops_no_stream(pty_card: PtyCardServer) -> None:
    with open_card(pty_card.url) as card:
        stream = card.open_stream("lookup")
        stream.prefill([1, 2, 3, 1, 2])
        hello = bytearray(
            encode_frame(Opcode.HELLO, 7, 0, m.encode_hello_request(m.HelloRequest(1, 1, "noise")))
        )
        hello[-1] ^= 0xFF  # its CRC fails: noise, not a host's HELLO
        fd = os.open(pty_card.path, os.O_WRONLY | os.O_NOCTTY)
        try:
            os.write(fd, encode_stream_frame(bytes(hello)))
        finally:
            os.close(fd)
        assert stream.draft(2).tokens == (3, 1)  # the stream is still there
        assert card.stats()["frames_dropped"] == 1


def test_a_checked_hello_starts_a_fresh_session_on_a_point_to_point_link() -> None:
    runtime = CardRuntime(4, 1024, background_prefetch=False)
    link = HostLink(runtime, "serial", single_host=True)
    hello = encode_frame(Opcode.HELLO, 1, 0, m.encode_hello_request(m.HelloRequest(1, 1, "a")))
    link.handle(hello)
    request = m.encode_open_request(m.OpenRequest(ModelKind.ENGINE, "lookup"))
    opened = link.handle(encode_frame(Opcode.OPEN, 2, 0, request))
    assert opened is not None
    handle = m.decode_open_reply(decode_frame(opened).payload).handle
    draft = encode_frame(Opcode.DRAFT, 3, handle, bytes([2]))
    assert decode_frame(link.handle(draft) or b"").opcode == Opcode.DRAFT | RESPONSE_BIT
    link.handle(hello)  # the host rebooted: its streams go
    assert decode_frame(link.handle(draft) or b"").opcode == Opcode.ERROR
    runtime.shutdown()


def test_the_replies_of_one_read_come_back_as_one_write() -> None:
    runtime = CardRuntime(4, 1024, background_prefetch=False)
    link = HostLink(runtime, "tcp")
    pings = [encode_frame(Opcode.PING, rid, 0, bytes([rid])) for rid in (1, 2, 3)]
    hello = encode_frame(Opcode.HELLO, 9, 0, m.encode_hello_request(m.HelloRequest(1, 1, "a")))
    out = link.feed(b"".join(encode_stream_frame(f) for f in [hello, *pings]))
    replies = Deframer().feed(out)
    assert [r[2] for r in replies] == [9, 1, 2, 3]  # all four, in order, in one buffer
    assert link.feed(b"\x05garbage\x00") == b"" and runtime.telemetry.frames_dropped == 1
    link.close()
    runtime.shutdown()


class RecordingLookup(LookupEngine):
    """The built-in lookup engine, noting the size of every batch the runtime drafts with it."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def propose_many(self, jobs: Sequence[tuple[EngineState, int, bytes]]) -> list[Proposal]:
        self.batches.append(len(jobs))
        return super().propose_many(jobs)


def _batch_of_misses(card: Card) -> list[tuple[int, ...]]:
    """Three streams' rounds sent together; with no drafting ahead on the card (prefetch off),
    the card drafts all three after their COMMITs arrive."""
    streams = [card.open_stream("lookup") for _ in range(3)]
    periods = [[10 + i, 20 + i, 30 + i] for i in range(3)]
    for s, p in zip(streams, periods, strict=True):
        s.prefill(p * 2 + p[:2])
        assert s.draft(2).tokens == (p[2], p[0])
    verdicts = [Verdict(0, p[2]) for p in periods]
    with card.sent_together():
        rids = [s.send_commit(v, 3) for s, v in zip(streams, verdicts, strict=True)]
    return [
        s.receive_commit(rid, v).tokens for s, rid, v in zip(streams, rids, verdicts, strict=True)
    ]


def test_emu_and_tcp_draft_a_batch_of_misses_as_one() -> None:
    """The same rounds sent together over emu:// and over TCP: the same drafts, and the card's
    engine asked once for all three on both links (not once a stream on emu://)."""
    drafts, batches = {}, {}
    for link in ("emu", "tcp"):
        engine = RecordingLookup()
        runtime = CardRuntime(4, 1024, engines=[engine], prefetch=False)
        if link == "emu":
            with Card(EmuTransport(runtime, owns_runtime=True)) as card:
                drafts[link] = _batch_of_misses(card)
        else:
            with served(runtime) as server, open_card(server.url) as card:
                drafts[link] = _batch_of_misses(card)
        batches[link] = engine.batches
    assert drafts["emu"] == drafts["tcp"] == [(10 + i, 20 + i, 30 + i) for i in range(3)]
    assert batches["emu"] == batches["tcp"] == [3]
