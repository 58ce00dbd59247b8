"""Faults that used to lose something: the image store's slot rules across power cuts and
rollbacks, abandoned uploads, damaged images at boot, durability, names, out-of-vocabulary ids.
Each test replays a defect as it was reported (issue "Faults that still lose something")."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from exstill_firmware.store import PowerCut, Store

from exstill_sdk import (
    CardFullError,
    InvalidArgumentError,
    StoreError,
    StoreFullError,
    open_card,
)
from exstill_sdk.flash import flash
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import ImageState
from exstill_sdk.protocol.drafts import Verdict

from ..cli.helpers import script, start_emu
from .conftest import card_on, serving_version

CHUNK = 32768


def states(root: Path, target: str = "tiny") -> dict[int, ImageState]:
    return {slot: state for name, slot, state, *_ in Store(root).entries() if name == target}


def v1_v2(images: dict[str, Path], root: Path) -> None:
    """v1 then v2 flashed and confirmed: v2 serves, v1 is kept for rollback."""
    with card_on(Store(root)) as card:
        flash(card, images["1"])
        flash(card, images["2"])


def test_a_rollback_after_a_cut_upload_never_serves_an_unchecked_image(images, tmp_path):
    """Cut v3's upload anywhere (mid-data, or in the journal writes that finish it), restart,
    roll back, flash v3 again: at every restart the serving image is one a health check
    confirmed, and at the end v3 is, after its own health check."""
    template = tmp_path / "template"
    v1_v2(images, template)
    size = images["3"].stat().st_size
    probe = tmp_path / "probe"
    shutil.copytree(template, probe)
    store = Store(probe)
    with card_on(store) as card:
        flash(card, images["3"], chunk_size=CHUNK)
    total = store.written  # every byte a v3 flash writes: data, then its journal updates
    cuts = [size // 3, size // 2, *range(size - 50, total, 60)]
    for i, cut in enumerate(cuts):
        root = tmp_path / f"cut{i}"
        shutil.copytree(template, root)
        with pytest.raises(PowerCut), card_on(Store(root, fault_after_bytes=cut)) as card:
            flash(card, images["3"], chunk_size=CHUNK)
        assert serving_version(root) == "2"
        with card_on(Store(root)) as card:  # restart, then roll back
            try:
                card.revert("tiny")
                rolled_back = True
            except InvalidArgumentError:  # the cut came after v1's slot was given to v3
                rolled_back = False
        assert serving_version(root) == ("1" if rolled_back else "2"), cut
        listed = states(root)
        assert list(listed.values()).count(ImageState.CONFIRMED) == 1, cut
        if rolled_back:
            assert listed == {0: ImageState.CONFIRMED, 1: ImageState.PREVIOUS}, cut
        with card_on(Store(root)) as card:  # restart, then flash v3 again
            result = flash(card, images["3"], chunk_size=CHUNK)
        assert result.confirmed and serving_version(root) == "3"
        listed = states(root)
        assert sorted(listed.values()) == [ImageState.CONFIRMED, ImageState.PREVIOUS], cut
        shutil.rmtree(root)


def test_an_upload_into_a_slot_that_changed_roles_is_dropped(images, tmp_path):
    v1_v2(images, tmp_path)  # confirmed b (v2), previous a (v1)
    with pytest.raises(PowerCut), card_on(Store(tmp_path, fault_after_bytes=200_000)) as card:
        flash(card, images["3"], chunk_size=CHUNK)  # a partial v3 upload into slot a
    assert Store(tmp_path).state["upload"]["slot"] == "a"
    with card_on(Store(tmp_path)) as card:
        card.revert("tiny")  # slot a serves again: its partial upload must go
    store = Store(tmp_path)
    assert store.state["upload"] is None and not (tmp_path / "tiny" / "a.part").exists()
    assert states(tmp_path) == {0: ImageState.CONFIRMED, 1: ImageState.PREVIOUS}


def test_abandoned_uploads_do_not_fill_the_target_table(images, tmp_path):
    digest = hashlib.sha256(images["2"].read_bytes()).digest()
    size = images["2"].stat().st_size
    with card_on(Store(tmp_path)) as card:
        for i in range(Store.MAX_TARGETS + 2):  # interrupted flashes, mistyped targets
            card.upload_begin(m.UploadBegin(size, digest, f"typo{i}", "1"))
        listed = {e.target for e in card.list_images()}
        assert listed == {f"typo{Store.MAX_TARGETS + 1}"}  # the one upload in progress
    with card_on(Store(tmp_path)) as card:  # after a restart a new target still flashes
        assert flash(card, images["1"]).confirmed
        assert {e.target for e in card.list_images()} == {"tiny"}  # typo9's upload abandoned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.json", "tiny"]


def test_a_full_table_still_counts_only_targets_that_hold_an_image(images, tmp_path):
    store = Store(tmp_path)
    for i in range(Store.MAX_TARGETS):
        store.state["targets"][f"t{i}"] = {
            "slots": {"a": {"digest": "00" * 32, "size": 1, "version": "1"}},
            "confirmed": "a",
            "testing": None,
            "previous": None,
        }
    with pytest.raises(StoreFullError, match="erase one"):
        store.begin("one-more", 10, bytes(32), "1", False)


def test_the_builtin_engine_name_is_refused_as_a_target(images, tmp_path):
    with card_on(Store(tmp_path)) as card:
        with pytest.raises(InvalidArgumentError, match="built-in engine"):
            flash(card, images["1"], target="lookup")
        assert card.info().engines == ("lookup",)
        with card.open_stream("lookup") as s:
            s.prefill([1, 2, 1, 2])
            assert s.draft(2).tokens == (1, 2)


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "missing":
        path.unlink()
    else:  # one bit flipped in the middle of the weights
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("how", ["truncated", "missing", "bit flip"])
def test_a_damaged_serving_image_is_set_aside_for_the_other_slot(images, tmp_path, how):
    v1_v2(images, tmp_path)  # v2 serves from slot b
    _damage(tmp_path / "tiny" / "b.img", how)
    with card_on(Store(tmp_path)) as card:
        assert card.stats()["images_set_aside"] == 1
        listed = {e.slot: ImageState(e.state) for e in card.list_images()}
        assert listed == {0: ImageState.CONFIRMED, 1: ImageState.DAMAGED}
        with card.open_stream(target="tiny") as s:  # v1 serves
            s.prefill([5, 6, 7])
            assert len(s.draft(2).tokens) == 2
    assert serving_version(tmp_path) == "1"


def test_with_every_image_damaged_the_card_still_serves_the_rest(images, tmp_path, admin_key):
    v1_v2(images, tmp_path)
    _damage(tmp_path / "tiny" / "a.img", "truncated")
    _damage(tmp_path / "tiny" / "b.img", "bit flip")
    proc, url = start_emu("--store", str(tmp_path), "--admin-key", str(admin_key))  # exited 2
    try:
        with open_card(url, key=admin_key) as card:
            assert "tiny" not in {t.name for t in card.info().targets}
            assert card.stats()["images_set_aside"] == 2
            with card.open_stream("lookup") as s:
                s.prefill([1, 2, 1, 2])
                assert s.draft(2).tokens == (1, 2)
            assert {ImageState(e.state) for e in card.list_images()} == {ImageState.DAMAGED}
            card.erase("tiny")
            assert card.list_images() == []
            assert flash(card, images["1"]).confirmed  # the operator flashes it again
    finally:
        proc.terminate()
        proc.wait(10)


def test_data_is_on_disk_before_its_rename_and_the_rename_after(images, tmp_path, monkeypatch):
    """The order of the real system calls while an upload finishes (they run as usual)."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        calls.append(("rename", f"{src} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with card_on(Store(tmp_path)) as card:
        flash(card, images["1"])
    part, img, folder = (
        str(tmp_path / "tiny" / "a.part"),
        str(tmp_path / "tiny" / "a.img"),
        str(tmp_path / "tiny"),
    )
    i = calls.index(("rename", f"{part} -> {img}"))
    assert ("fsync", part) in calls[:i]  # the data, before the rename
    assert ("fsync", folder) in calls[i + 1 :]  # the directory entry, after it
    journal_renames = [j for j, c in enumerate(calls) if c[1].endswith("journal.json")]
    assert journal_renames and all(
        ("fsync", str(tmp_path)) in calls[j + 1 :] for j in journal_renames
    )


@pytest.mark.parametrize(
    "journal",
    [
        "[1, 2, 3]",
        '{"targets": {"tiny": {"slots": []}}}',
        '{"targets": {"tiny": {"slots": {}, "confirmed": "c"}}, "upload": null}',
        '{"targets": {}, "upload": {"target": "x"}}',
    ],
)
def test_a_journal_of_the_wrong_shape_is_a_typed_error_naming_the_file(tmp_path, journal):
    (tmp_path / "journal.json").write_text(journal)
    with pytest.raises(StoreError, match=r"journal\.json is not an image-store journal"):
        Store(tmp_path)
    out = subprocess.run(
        [script("exstill-emu"), "--listen", "tcp://127.0.0.1:0", "--store", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # the card's store said no (exit 1), in one line
    assert out.returncode == 1 and "journal.json is not an image-store journal" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_out_of_vocabulary_ids_change_nothing(images, tmp_path):
    vocab = 1024  # the tiny target's
    with card_on(Store(tmp_path)) as card:
        flash(card, images["1"])
        with card.open_stream(target="tiny") as s:
            s.prefill([5, 6, 7])
            draft = s.draft(3)
            with pytest.raises(InvalidArgumentError, match="vocabulary of 1024"):
                s.commit(Verdict(1, vocab), 3)  # a bonus id at the vocabulary's size
            assert s.length == 3
            assert s.commit(Verdict(1, 9), 3).tokens  # the stream is as it was: the round goes on
            assert s.length == 5
            with pytest.raises(InvalidArgumentError, match="vocabulary"):
                s.prefill([1, 2, vocab + 5])
            assert s.length == 5 and len(s.draft(2).tokens) == 2
            del draft
        assert json.dumps(card.stats())  # the card still answers


def _open_when_freed(url: str):
    """A connection once the card has noticed a closed one: the card learns of it when its
    server reads the end of that connection, a moment after the client closed it. Asked again
    until it serves (the verdict is whether it serves, not how soon)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return open_card(url)
        except CardFullError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_connections_beyond_the_limit_are_told_why_at_once(tmp_path):
    proc, url = start_emu("--max-connections", "2")
    try:
        first, second = open_card(url), open_card(url)
        # the reason, not a timeout (that would be LinkTimeoutError after 30 s)
        with pytest.raises(CardFullError, match="serves 2 connections already"):
            open_card(url, timeout=30)
        second.close()
        with _open_when_freed(url) as third:  # a freed place serves again
            assert third.ping() > 0
        first.close()
    finally:
        proc.terminate()
        proc.wait(10)
