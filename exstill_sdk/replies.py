"""Requests and replies over one link, from any number of threads.

Each request gets a request id; whichever waiting thread holds the reader role reads frames
and hands each reply to its owner by id (no reader thread, so a single-threaded caller never
hands off to another thread). A reply that fails its length, CRC or version check, or whose id
nobody waits for any more (late or duplicate), is counted and dropped.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from zlib import crc32

from exstill_sdk.errors import DeviceLostError, LinkTimeoutError
from exstill_sdk.protocol.constants import CRC_SIZE, FRAME_OVERHEAD, PROTOCOL_VERSION
from exstill_sdk.protocol.frame import CRC, HEADER
from exstill_sdk.transport import Transport


class ReplyMultiplexer:
    def __init__(self, transport: Transport, rids: Iterator[int] | None = None) -> None:
        """``rids``: where request ids come from (a reconnected card's new link continues the
        old link's, so that no id is awaited on both)."""
        self.transport = transport
        self._rids = rids or itertools.count(1)
        self._send_lock = threading.Lock()
        self._reader = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting_threads = 0
        self._pending: set[int] = set()
        self._done: dict[int, bytes] = {}
        self.dropped = 0
        """Late, duplicate or corrupt reply frames discarded."""

    def next_rid(self) -> int:
        """A request id, now awaited (``forget`` it if the request is not sent)."""
        # next() on itertools.count is atomic under the GIL; 65,536 ids in flight cannot happen.
        rid = next(self._rids) & 0xFFFF
        self._pending.add(rid)
        return rid

    def forget(self, rid: int) -> None:
        """Stop awaiting ``rid``: its reply, if one comes, is dropped."""
        self._pending.discard(rid)

    def send(self, frame: bytes, rid: int) -> None:
        """Send request ``rid``'s frame; a failed send forgets the request."""
        try:
            with self._send_lock:
                self.transport.send_frame(frame)
        except BaseException:
            self._pending.discard(rid)
            raise

    def send_many(self, frames: list[tuple[bytes, int]]) -> None:
        """Send several requests' frames in one write; a failed send forgets them all."""
        try:
            with self._send_lock:
                self.transport.send_frames([frame for frame, _ in frames])
        except BaseException:
            for _, rid in frames:
                self._pending.discard(rid)
            raise

    def receive(self, rid: int, deadline: float) -> bytes:
        """Request ``rid``'s reply frame (whole and checked, not yet interpreted). A request
        this link never sent (it went out on a link reopened since) is lost at once."""
        if rid not in self._pending and rid not in self._done:
            raise DeviceLostError(
                f"{self.transport.url or 'the card'}: the link was reopened while request "
                f"{rid} waited; its reply is gone"
            )
        try:
            return self._await(rid, deadline)
        finally:
            self._pending.discard(rid)

    def _await(self, rid: int, deadline: float) -> bytes:
        """Request ``rid``'s reply: taken from those already read, or read as the link's reader,
        or waited for while another thread reads."""
        done = self._done
        while True:
            reply = done.pop(rid, None)
            if reply is not None:
                return reply
            if self._reader.acquire(blocking=False):
                try:
                    return self._read_until(rid, deadline)
                finally:
                    self._reader.release()
                    if self._waiting_threads:
                        with self._cond:
                            self._cond.notify_all()
            with self._cond:
                self._waiting_threads += 1
                try:
                    while rid not in done and self._reader.locked():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            where = self.transport.url or "the card"
                            raise LinkTimeoutError(f"no reply from {where} within the timeout")
                        self._cond.wait(remaining)
                finally:
                    self._waiting_threads -= 1

    def _read_until(self, rid: int, deadline: float) -> bytes:
        """Read frames as the reader until ``rid``'s reply arrives; hand others to their owners."""
        done = self._done
        while True:
            reply = done.pop(rid, None)
            if reply is not None:
                return reply
            frame = self.transport.recv_frame(deadline)
            n = len(frame)
            if (
                n < FRAME_OVERHEAD
                or n != FRAME_OVERHEAD + HEADER.unpack_from(frame)[4]
                or crc32(memoryview(frame)[: n - CRC_SIZE])
                != CRC.unpack_from(frame, n - CRC_SIZE)[0]
                or frame[0] != PROTOCOL_VERSION
            ):
                self.dropped += 1
                continue
            got = frame[2] | frame[3] << 8
            if got == rid:
                return frame
            if got in self._pending and got not in done:
                done[got] = frame
                if self._waiting_threads:
                    with self._cond:
                        self._cond.notify_all()
            else:
                self.dropped += 1
