"""Flashing: upload, verify, A/B slots, trial and confirm, resume, power cuts, refusals."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.store import PowerCut, Store

from exstill_sdk import (
    ChunkError,
    DowngradeRefusedError,
    ImageSignatureError,
    open_card,
)
from exstill_sdk.card import Card
from exstill_sdk.flash import flash
from exstill_sdk.image import load_trusted_keys
from exstill_sdk.protocol.constants import ImageState
from exstill_sdk.transport.emu import EmuTransport

from ..helpers import served
from .conftest import card_on, serving_version


def test_flash_confirm_revert_and_downgrade(images, tmp_path: Path) -> None:
    with card_on(Store(tmp_path)) as card:
        r1 = flash(card, images["1"])
        assert r1.confirmed and r1.resent_bytes == 0 and r1.bytes_sent == r1.size
        with card.open_stream(target="tiny") as s:
            s.prefill([5, 6, 7])
            assert len(s.draft(3).tokens) == 3
        old_stream = card.open_stream(target="tiny")
        old_stream.prefill([1, 2, 3])
        flash(card, images["2"])
        assert len(old_stream.draft(2).tokens) == 2  # streams on the old image keep working
        states = {(e.version, e.state) for e in card.list_images()}
        assert states == {("1", ImageState.PREVIOUS), ("2", ImageState.CONFIRMED)}
        with pytest.raises(DowngradeRefusedError, match="--allow-downgrade"):
            flash(card, images["1"])
        card.revert("tiny")
        assert {(e.version, e.state) for e in card.list_images()} == {
            ("1", ImageState.CONFIRMED),
            ("2", ImageState.PREVIOUS),
        }
        flash(card, images["2"], confirm=False)  # on trial only
    assert serving_version(tmp_path) == "1"  # a reset drops the unconfirmed trial
    with card_on(Store(tmp_path)) as card:
        flash(card, images["1"], allow_downgrade=True)
        card.erase("tiny")
        assert card.list_images() == []
        from exstill_sdk import UnknownModelError

        with pytest.raises(UnknownModelError):
            card.open_stream(target="tiny")


def test_trusted_keys_refuse_unsigned_and_foreign_images(images, tmp_path: Path) -> None:
    keys = images["keys"]
    store = Store(tmp_path, trusted_keys=load_trusted_keys(keys / "vendor.pub"))
    with card_on(store) as card:
        flash(card, images["3"])  # signed by the vendor key
        with pytest.raises(ImageSignatureError, match="not signed"):
            flash(card, images["2"], allow_downgrade=True)
        assert serving_version(tmp_path) == "3"
    store = Store(tmp_path, trusted_keys=load_trusted_keys(keys / "other.pub"))
    with card_on(store) as card, pytest.raises(ImageSignatureError, match="not among"):
        flash(card, images["3"], allow_downgrade=True)
    assert serving_version(tmp_path) == "3"


def test_corrupted_chunks_are_detected_and_resent(images, tmp_path: Path) -> None:
    with card_on(Store(tmp_path)) as card:
        from exstill_sdk.protocol import messages as m
        from exstill_sdk.protocol.constants import Opcode

        size = images["1"].stat().st_size
        req = m.UploadBegin(size, bytes(32), "tiny", "1")
        card.upload_begin(req)
        rid = card.send_pipelined(Opcode.UPLOAD_CHUNK, m.UPLOAD_CHUNK_HEAD.pack(0, 1234) + b"abc")
        with pytest.raises(ChunkError, match="CRC"):
            card.receive_pipelined(rid, Opcode.UPLOAD_CHUNK)

    class Flaky(Store):
        """A card that finds every 5th chunk corrupted (as after a bit flip on the link)."""

        calls = 0

        def chunk(self, offset, data, crc):
            Flaky.calls += 1
            if Flaky.calls % 5 == 0:
                raise ChunkError(f"chunk at {offset} failed its CRC; resend from {offset}")
            return super().chunk(offset, data, crc)

    with card_on(Flaky(tmp_path / "flaky")) as card:
        result = flash(card, images["1"], chunk_size=32768)
        assert result.resent_bytes > 0
    assert serving_version(tmp_path / "flaky") == "1"


def test_dropped_links_resume(images, tmp_path: Path) -> None:
    key = b"k" * 32
    runtime = CardRuntime(4, 256, store=Store(tmp_path), background_prefetch=False, admin_key=key)
    rng = random.Random(5)
    with served(runtime) as server:
        for trial in range(6):
            size = images["2"].stat().st_size
            cut_at = {rng.randrange(1, size)}
            with open_card(server.url, key=key) as card:
                if trial % 2:
                    card.erase("tiny") if card.list_images() else None

                def drop(offset: int, card=card, cut_at=cut_at) -> None:
                    if cut_at and offset >= min(cut_at):
                        cut_at.clear()
                        card.transport.interrupt()  # the link dies mid-upload

                # one chunk in flight: resuming costs at most that chunk
                result = flash(
                    card,
                    images["2"],
                    on_chunk=drop,
                    allow_downgrade=True,
                    window=1,
                    chunk_size=32768,
                )
                assert len(result.resumed_from) == 1
                assert result.resent_bytes <= 32768
            assert serving_version(tmp_path) == "2"


CHUNK = 32768  # small chunks: many boundaries to cut at


def _write_plan(images, template: Path) -> int:
    """Bytes the store writes to flash v2 over v1 (data and journal), measured."""
    work = template.parent / "measure"
    shutil.copytree(template, work)
    store = Store(work)
    with card_on(store) as card:
        flash(card, images["2"], chunk_size=CHUNK)
    return store.written


def test_power_cut_at_any_byte_leaves_a_bootable_image(images, tmp_path: Path) -> None:
    template = tmp_path / "template"
    with card_on(Store(template)) as card:
        flash(card, images["1"])
    total = _write_plan(images, template)
    boundaries = list(range(0, images["2"].stat().st_size, CHUNK))
    rng = random.Random(11)
    cuts = sorted(set(boundaries) | {rng.randrange(total) for _ in range(100)})
    outcomes = {"1": 0, "2": 0}
    for i, cut in enumerate(cuts):
        root = tmp_path / f"cut{i}"
        shutil.copytree(template, root)
        try:
            with card_on(Store(root, fault_after_bytes=cut)) as card:
                flash(card, images["2"], chunk_size=CHUNK)
        except PowerCut:
            pass
        version = serving_version(root)  # boots from the store: digest-checked image
        outcomes[version] += 1
        if version == "2":  # only once confirmed (the confirm journal write completed)
            assert Store(root).state["targets"]["tiny"]["confirmed"]
        if i % 20 == 0:  # and the card serves it
            with card_on(Store(root)) as card, card.open_stream(target="tiny") as s:
                s.prefill([3, 4, 5])
                assert len(s.draft(2).tokens) == 2
        shutil.rmtree(root)
    assert outcomes["1"] > 100  # most cuts land before the confirm: the old image serves


def test_card_refuses_a_foreign_architecture_and_keeps_the_old_image(
    images, tmp_path: Path
) -> None:
    """The card checks an upload in full itself: an image whose architecture the firmware does
    not run is refused at UPLOAD_END (and exstill-flash refuses it before sending a byte)."""
    from exstill_sdk import ImageError
    from exstill_sdk.flash import file_digest, upload
    from exstill_sdk.image.format import MetaType
    from exstill_sdk.protocol import messages as m
    from tests.image.hostile import with_metadata

    def foreign(meta: dict) -> None:
        meta["arch.name"] = (MetaType.STR, "mamba")
        meta["image.version"] = (MetaType.STR, "9")

    bad = tmp_path / "mamba.img"
    bad.write_bytes(with_metadata(images["1"].read_bytes(), foreign))
    with card_on(Store(tmp_path / "store")) as card:
        flash(card, images["1"])
        with pytest.raises(ImageError, match="not supported"):
            flash(card, bad)  # refused locally
        req = m.UploadBegin(bad.stat().st_size, file_digest(bad), "tiny", "9", False)
        upload(card, bad, req)
        with pytest.raises(ImageError, match="architecture 'mamba' is not supported"):
            card.upload_end()
        assert {(e.version, e.state) for e in card.list_images()} == {("1", ImageState.CONFIRMED)}
        with card.open_stream(target="tiny") as s:
            s.prefill([1, 2, 3])
            assert len(s.draft(2).tokens) == 2
    assert sorted(p.name for p in (tmp_path / "store" / "tiny").iterdir()) == ["a.img"]


def test_a_full_store_refuses_before_any_byte_is_written(images, tmp_path: Path) -> None:
    from exstill_sdk import StoreFullError

    size = images["1"].stat().st_size
    with card_on(Store(tmp_path, max_bytes=size * 3 // 2)) as card:
        flash(card, images["1"])
        with pytest.raises(StoreFullError, match="erase a target first"):
            flash(card, images["2"])
        assert [e.version for e in card.list_images()] == ["1"]
        card.erase("tiny")
        flash(card, images["2"])
        assert [e.version for e in card.list_images()] == ["2"]


def test_flashed_images_run_with_the_cards_compute_threads(images, tmp_path: Path) -> None:
    from exstill_firmware.engines.transformer import TransformerEngine

    runtime = CardRuntime(4, 256, store=Store(tmp_path), prefetch=False, threads=1)
    with Card(EmuTransport(runtime, owns_runtime=True)) as card:
        flash(card, images["1"])
        engine = runtime.models["tiny"]
        assert isinstance(engine, TransformerEngine)
        assert engine.runner.session.get_session_options().intra_op_num_threads == 1
