"""A pool of cards as one card: real card runtimes on real loopback sockets, a real decoder."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import CardOptions, TcpCardServer, build_runtime

from exstill_sdk import (
    BadURLError,
    Card,
    CardFullError,
    CardPool,
    DeviceLostError,
    TransportError,
    UnknownModelError,
    open_cards,
)
from exstill_sdk.adapters.rows import RowStreams
from exstill_sdk.pool import split_card_urls
from exstill_sdk.speculative import SpeculativeDecoder

from .adapters.test_rows import WIDTH, Batch, K, reference
from .helpers import CycleTarget, cycle_reference, served, tiny_image


class Server:
    """A card runtime on a loopback port that can be killed and brought back on that port."""

    def __init__(self, runtime: Callable[[], CardRuntime]) -> None:
        self._runtime = runtime
        self.port = 0
        self.start()

    def start(self) -> None:
        self.runtime = self._runtime()
        self.server = TcpCardServer(self.runtime, port=self.port)
        self.port = self.server.port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        """The card goes away at once: its port closes, its connections drop."""
        self.server.close()
        self.thread.join(5)
        self.runtime.shutdown()


@contextmanager
def cards(n: int, slots: int = 12) -> Iterator[list[Server]]:
    servers = [
        Server(lambda: CardRuntime(slots, 4096, background_prefetch=False)) for _ in range(n)
    ]
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()


def pool_url(servers: Sequence[Server]) -> str:
    return ",".join(s.url for s in servers)


class KillingTarget(CycleTarget):
    """CycleTarget that runs ``action`` just before its ``after``-th verification pass."""

    def __init__(self, after: int, action: Callable[[], None]) -> None:
        self.after, self.action, self.passes = after, action, 0

    def verify_batch(
        self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]]
    ) -> list[np.ndarray]:
        self.passes += 1
        if self.passes == self.after:
            self.action()
        return super().verify_batch(items)


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 6, 7, 5 + i, 6, 7] for i in range(n)]


def test_pool_urls_split_at_schemes() -> None:
    assert split_card_urls("tcp://a:1") == ["tcp://a:1"]
    assert split_card_urls("emu://?engine=lookup,ngram,tcp://b:2, serial:/dev/ttyACM0") == [
        "emu://?engine=lookup,ngram",
        "tcp://b:2",
        "serial:/dev/ttyACM0",
    ]
    with pytest.raises(BadURLError, match="none empty"):
        split_card_urls(",tcp://a:1")
    with pytest.raises(BadURLError, match="named twice"):
        CardPool(["emu://", "emu://"])


def test_open_cards_gives_a_card_or_a_pool() -> None:
    with open_cards("emu://") as card:
        assert isinstance(card, Card)
    with cards(2) as servers, open_cards(pool_url(servers)) as pool:
        assert isinstance(pool, CardPool)
        info = pool.info()
        assert info.slots == 24 and info.context == 4096 and "lookup" in info.engines


def test_streams_go_to_the_least_loaded_card_and_capacity_is_the_sum() -> None:
    with cards(2, slots=3) as servers, CardPool([s.url for s in servers]) as pool:
        a, b = pool.members
        streams = [pool.open_stream("lookup") for _ in range(6)]
        assert (a.placed, b.placed) == (3, 3)
        assert pool.stats()["streams_open"] == 6
        assert {u: st["streams_open"] for u, st in pool.member_stats().items()} == {
            a.url: 3,
            b.url: 3,
        }
        with pytest.raises(CardFullError, match="2 card"):
            pool.open_stream("lookup")
        streams[0].close()  # a's or b's: the next stream goes where the room is
        again = pool.open_stream("lookup")
        assert again.card is streams[0].card
        again.prefill([1, 2, 3, 1, 2])
        assert again.draft(2).tokens == (3, 1)


def test_a_card_without_the_target_is_skipped(tmp_path: Path) -> None:
    image = tiny_image(tmp_path / "tiny.img", "tiny")
    other = tiny_image(tmp_path / "other.img", "tiny", vocab=80)
    with_image = build_runtime(CardOptions(slots=4, context=512, images=(str(image),)))
    plain = CardRuntime(4, 512)
    conflicting = build_runtime(CardOptions(slots=4, context=512, images=(str(other),)))
    with (
        served(with_image) as s1,
        served(plain) as s2,
        served(conflicting) as s3,
        CardPool([s1.url, s2.url, s3.url]) as pool,
    ):
        holder, skipped, refused = pool.members
        assert refused.card is None and "another tokenizer" in refused.why
        assert [t.name for t in pool.info().targets] == ["tiny"] and pool.info().slots == 8
        streams = [pool.open_stream(target="tiny") for _ in range(3)]
        assert all(st.card is holder.card for st in streams)
        assert (holder.placed, skipped.placed) == (3, 0)
        with pytest.raises(UnknownModelError, match="no card of the pool holds"):
            pool.open_stream(target="absent")


def test_24_users_on_two_cards_match_the_target_alone() -> None:
    with cards(2) as servers, CardPool([s.url for s in servers]) as pool:
        decoder = SpeculativeDecoder(pool, CycleTarget(), engine="lookup", k=4)
        results = decoder.generate_batch(prompts(24), 40, stop_token_ids=[])
        assert [r.tokens for r in results] == [cycle_reference(p, 40) for p in prompts(24)]
        assert [m.placed for m in pool.members] == [12, 12]
        assert decoder.metrics.num_accepted_tokens > 0
        assert pool.stats()["streams_open"] == 0


def test_a_card_lost_mid_run_costs_only_its_streams_and_rejoins() -> None:
    with cards(2) as servers, CardPool([s.url for s in servers], rejoin_s=3600) as pool:
        a, b = pool.members
        target = KillingTarget(after=6, action=servers[1].kill)
        decoder = SpeculativeDecoder(pool, target, engine="lookup", k=4)
        results = decoder.generate_batch(prompts(6), 60, stop_token_ids=[])
        assert [r.tokens for r in results] == [cycle_reference(p, 60) for p in prompts(6)]
        assert decoder.reconnects == 1
        assert b.card is None and b.lost == 1 and pool.info().slots == 12
        # a kept its own three streams and took b's three: six placed there, not nine
        assert (a.placed, b.placed) == (6, 3)
        servers[1].start()  # the card comes back on its port
        assert pool.rejoin() == 0  # not yet: it is tried every rejoin_s
        assert pool.rejoin(force=True) == 1 and pool.info().slots == 24
        first = pool.open_stream("lookup")
        second = pool.open_stream("lookup")
        assert {first.card, second.card} == {a.card, b.card}


def test_no_card_up_is_a_lost_device() -> None:
    with cards(1) as servers:
        pool = CardPool([servers[0].url, "tcp://127.0.0.1:9"], rejoin_s=3600)
        assert pool.members[1].card is None and pool.info().slots == 12
        servers[0].kill()
        with pytest.raises(DeviceLostError, match="no card of the pool answers"):
            pool.reconnect()
        servers[0].start()
        pool.close()
    with pytest.raises(TransportError, match=r"nothing listens on 127\.0\.0\.1:9;"):
        CardPool(["tcp://127.0.0.1:9", "tcp://127.0.0.1:11"])


def test_row_streams_on_a_pool_lose_only_the_lost_cards_rows() -> None:
    with cards(2) as servers, CardPool([s.url for s in servers], rejoin_s=3600) as pool:
        a, b = pool.members
        rows = RowStreams(pool, engine="lookup")
        batch = Batch()
        for r in range(8):
            batch.add(r)
            batch.rows[r]["sampled"] = [reference(r)[12]]  # the prompt's step
            batch.rows[r]["tokens"] = reference(r)[:13]
        for step in range(8):
            if step == 4:
                servers[1].kill()
            sampled, lengths, tokens = batch.arrays()
            drafts = rows.propose(sampled, lengths, tokens, K, max_length=WIDTH)
            if step == 0:
                assert (a.placed, b.placed) == (4, 4)
            if step == 4:  # the lost card's rows go without drafts this step
                assert rows.stats.reconnects == 1 and b.card is None
            for row, draft in zip(batch.rows, drafts, strict=True):
                row["draft"] = draft
            batch.step()
        # a kept its four rows' streams and took b's four: eight placed there, not twelve
        assert (a.placed, b.placed) == (8, 4) and rows.stats.opened == 12
        assert pool.stats()["streams_open"] == 8
        rows.close()
        assert pool.stats()["streams_open"] == 0
