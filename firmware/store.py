"""The card's image store: several targets, two slots each, power-cut safe.

Layout under the store root: ``journal.json`` (the state below) and, per target, ``a.img`` /
``b.img`` and the upload in progress ``<slot>.part``. Invariants that make a power cut at any
byte harmless:

- an upload only ever writes the slot that is not serving, as ``<slot>.part``, sequentially; the
  resume offset is that file's size (the host re-sends from there). When the slots change roles
  (activate, confirm, revert) a partial upload whose slot now serves is dropped, and a resumed
  upload must still be for the slot that does not serve;
- a finished upload replaces its slot in three journaled steps: the slot's old record is
  forgotten (so nothing can roll back to a file about to change), the verified file is renamed
  into place, then recorded; a rollback only ever goes to a recorded (complete, verified) image;
- data is fsynced before a rename, and the directory after it;
- an upload that is abandoned (another one begins, or it fails its check) leaves no target
  behind, so empty targets never fill the table;
- at boot every serving image is checked against the SHA-256 recorded when it was verified; a
  damaged one is set aside (``damaged`` in the list) and the other slot's verified image serves
  instead, or the target does not serve at all; the card serves everything else either way;
- the journal changes only by writing ``journal.json.tmp``, fsync, then an atomic rename: a cut
  leaves the old journal or the new one, never a torn one;
- a finished upload is checked in full (digest, structure, signature when trusted keys are
  configured) before it is renamed to ``<slot>.img`` and recorded;
- an image on trial (ACTIVATE) that is not confirmed is dropped at the next boot, so the
  confirmed image comes back.

``fault_after_bytes`` is the emulator's power-cut hook: the store raises PowerCut once that
many bytes have been written in total (data and journal), leaving everything as a real cut
would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any
from zlib import crc32

from exstill_sdk.errors import (
    ChunkError,
    DowngradeRefusedError,
    ImageError,
    InvalidArgumentError,
    StoreError,
    StoreFullError,
    UnknownModelError,
)
from exstill_sdk.image import open_image
from exstill_sdk.image.signing import TrustedKeys
from exstill_sdk.protocol.constants import ImageState

SLOTS = ("a", "b")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _upload_slot(entry: dict[str, Any] | None) -> str:
    """The slot an upload writes: the one that neither serves nor is on trial."""
    if entry is None:
        return SLOTS[0]
    busy = {entry.get("confirmed"), entry.get("testing")}
    return next(s for s in (*SLOTS, SLOTS[0]) if s not in busy)


def _check_state(state: Any) -> None:
    """The journal's shape, or an exception saying what is wrong with it."""
    if not isinstance(state, dict) or not isinstance(state.get("targets"), dict):
        raise ValueError("no 'targets' table")
    for name, entry in state["targets"].items():
        if not NAME.match(name) or not isinstance(entry.get("slots"), dict):
            raise ValueError(f"target {name!r} is malformed")
        for slot, info in entry["slots"].items():
            if slot not in SLOTS or not {"digest", "size", "version"} <= set(info):
                raise ValueError(f"slot {slot!r} of {name!r} is malformed")
        for role in ("confirmed", "testing", "previous"):
            if entry.get(role) not in (None, *entry["slots"]):
                raise ValueError(f"{role} of {name!r} names no recorded slot")
    upload = state.get("upload")
    if upload is not None and not (
        isinstance(upload, dict)
        and {"target", "slot", "digest", "size", "version"} <= set(upload)
        and upload["slot"] in SLOTS
    ):
        raise ValueError("the upload record is malformed")


class PowerCut(BaseException):
    """The emulator's power-cut fault: the card stops right here."""


def version_key(version: str) -> tuple[Any, ...]:
    """Order versions like 1.2 < 1.10 < 2.0 (numeric parts compare as numbers)."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-+]", version))


class Store:
    MAX_TARGETS = 8

    def __init__(
        self,
        root: str | Path,
        *,
        max_bytes: int | None = None,
        trusted_keys: TrustedKeys | None = None,
        fault_after_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.trusted_keys = trusted_keys
        self.fault_after = fault_after_bytes
        self.written = 0
        self._part: Any = None
        self.state = self._load(self.root / "journal.json")
        self.damaged: dict[str, list[str]] = {}
        """Per target, the slots whose image failed the boot check (set aside, not served)."""
        self._boot()

    # ------------------------------------------------------------------ durability

    def _write(self, f: Any, data: bytes | memoryview) -> None:
        if self.fault_after is not None:
            allowed = self.fault_after - self.written
            if len(data) > allowed:
                f.write(data[: max(0, allowed)])
                f.flush()
                self.written = self.fault_after
                raise PowerCut(f"power cut after {self.fault_after} bytes")
        f.write(data)
        self.written += len(data)

    @staticmethod
    def _load(journal: Path) -> dict[str, Any]:
        """The journal's state; StoreError naming the file when it is not a store journal."""
        if not journal.exists():
            return {"targets": {}, "upload": None}
        try:
            state = json.loads(journal.read_text())
            _check_state(state)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise StoreError(
                f"{journal} is not an image-store journal ({exc}); move the store directory "
                "aside and flash the card again"
            ) from None
        return state  # type: ignore[no-any-return]

    def _fsync_dir(self, directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _save(self) -> None:
        tmp = self.root / "journal.json.tmp"
        with open(tmp, "wb") as f:
            self._write(f, json.dumps(self.state, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "journal.json")
        self._fsync_dir(self.root)

    def _boot(self) -> None:
        """After a reset: an unconfirmed trial image is dropped (the confirmed one serves), empty
        targets left by an interrupted upload are forgotten, and every serving image is checked
        against its recorded SHA-256 (a damaged one is set aside for the other slot's)."""
        changed = False
        upload = self.state.get("upload")
        for name, entry in list(self.state["targets"].items()):
            if entry.get("testing"):
                entry["testing"] = None
                changed = True
            if not entry["slots"] and not (upload and upload["target"] == name):
                del self.state["targets"][name]
                changed = True
                continue
            while (slot := entry.get("confirmed")) and not self._intact(name, slot):
                self._set_aside(name, slot)
                changed = True
        if changed:
            self._save()

    def _set_aside(self, target: str, slot: str) -> None:
        """Stop using a slot's image (not saved): the previous image, if any, serves instead."""
        entry = self.state["targets"][target]
        self.damaged.setdefault(target, []).append(slot)
        del entry["slots"][slot]
        for role in ("testing", "previous"):
            if entry.get(role) == slot:
                entry[role] = None
        if entry.get("confirmed") == slot:
            entry["confirmed"], entry["previous"] = entry.get("previous"), None

    def set_aside(self, target: str) -> Path | None:
        """The target's serving image does not load: set it aside; what serves now, if any."""
        self._set_aside(target, self.serving_slot(target))
        self._save()
        return self.serving().get(target)

    def _intact(self, target: str, slot: str) -> bool:
        """Whether the slot's file is whole and has the SHA-256 recorded when it was verified."""
        info = self.state["targets"][target]["slots"].get(slot)
        path = self.path(target, slot)
        if info is None or not path.exists() or path.stat().st_size != info["size"]:
            return False
        h = hashlib.sha256()
        with open(path, "rb") as r:
            while block := r.read(1 << 22):
                h.update(block)
        return h.hexdigest() == info["digest"]

    # ------------------------------------------------------------------ queries

    def _target(self, name: str) -> dict[str, Any]:
        entry = self.state["targets"].get(name)
        if entry is None:
            raise UnknownModelError(f"the store has no target {name!r}")
        return entry

    def path(self, target: str, slot: str) -> Path:
        return self.root / target / f"{slot}.img"

    def serving_slot(self, target: str) -> str:
        entry = self._target(target)
        return str(entry.get("testing") or entry.get("confirmed"))

    def serving(self) -> dict[str, Path]:
        """Each target's serving image: the one on trial, else the confirmed one."""
        out = {}
        for name, entry in self.state["targets"].items():
            slot = entry.get("testing") or entry.get("confirmed")
            if slot:
                out[name] = self.path(name, slot)
        return out

    def entries(self) -> list[tuple[str, int, ImageState, str, int, bytes]]:
        """(target, slot index, ImageState, version, size, sha256) for every slot in use."""
        out = []
        upload = self.state.get("upload")
        for name, entry in sorted(self.state["targets"].items()):
            for i, slot in enumerate(SLOTS):
                info = entry["slots"].get(slot)
                if upload and upload["target"] == name and upload["slot"] == slot:
                    part = self.root / name / f"{slot}.part"
                    size = part.stat().st_size if part.exists() else 0
                    out.append(
                        (
                            name,
                            i,
                            ImageState.PARTIAL,
                            upload["version"],
                            size,
                            bytes.fromhex(upload["digest"]),
                        )
                    )
                    continue
                if info is None:
                    continue
                if entry.get("testing") == slot:
                    state = ImageState.TESTING
                elif entry.get("confirmed") == slot:
                    state = ImageState.CONFIRMED
                elif entry.get("previous") == slot:
                    state = ImageState.PREVIOUS
                else:
                    state = ImageState.VERIFIED
                out.append(
                    (name, i, state, info["version"], info["size"], bytes.fromhex(info["digest"]))
                )
        for name, slots in sorted(self.damaged.items()):
            for slot in slots:
                size = self.path(name, slot).stat().st_size if self.path(name, slot).exists() else 0
                out.append((name, SLOTS.index(slot), ImageState.DAMAGED, "", size, bytes(32)))
        return out

    def _used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.img"))

    # ------------------------------------------------------------------ upload

    def begin(
        self, target: str, size: int, digest: bytes, version: str, allow_downgrade: bool
    ) -> int:
        """Start (or resume) an upload; the offset to send from."""
        if not NAME.match(target):
            raise InvalidArgumentError(f"target name {target!r}: use letters, digits, . _ -")
        entry = self.state["targets"].get(target)
        if entry is None and len(self._held_targets()) >= self.MAX_TARGETS:
            raise StoreFullError(
                f"the store holds {self.MAX_TARGETS} targets already; erase one first"
            )
        if self.max_bytes is not None and self._used_bytes() + size > self.max_bytes:
            raise StoreFullError(
                f"{size} more bytes do not fit in the store ({self._used_bytes()} of "
                f"{self.max_bytes} used); erase a target first"
            )
        if entry is not None:
            if entry.get("testing"):
                raise InvalidArgumentError(
                    f"target {target!r} has an image on trial: confirm or revert it first"
                )
            current = entry.get("confirmed")
            if current and not allow_downgrade:
                old = entry["slots"][current]["version"]
                if version_key(version) < version_key(old):
                    raise DowngradeRefusedError(
                        f"image version {version} is older than the confirmed {old}; "
                        "pass --allow-downgrade to install it anyway"
                    )
        upload: dict[str, Any] | None = self.state.get("upload")
        slot = _upload_slot(entry)
        if upload is not None and (
            upload["target"],
            upload["digest"],
            upload["size"],
            upload["slot"],
        ) == (target, digest.hex(), size, slot):
            part = self.root / target / f"{slot}.part"
            return part.stat().st_size if part.exists() else 0
        self._drop_upload()
        entry = self.state["targets"].get(target)  # dropping may have forgotten it
        if entry is None:
            entry = {"slots": {}, "confirmed": None, "testing": None, "previous": None}
            self.state["targets"][target] = entry
        (self.root / target).mkdir(exist_ok=True)
        (self.root / target / f"{slot}.part").write_bytes(b"")
        self.state["upload"] = {
            "target": target,
            "slot": slot,
            "digest": digest.hex(),
            "size": size,
            "version": version,
        }
        self._save()
        return 0

    def _drop_upload(self) -> None:
        """Abandon the upload in progress (not saved): its partial file goes, and its target
        too if that holds nothing else."""
        upload = self.state.get("upload")
        self._close_part()
        if upload:
            (self.root / upload["target"] / f"{upload['slot']}.part").unlink(missing_ok=True)
            self.state["upload"] = None
            self._drop_empty(upload["target"])

    def _part_file(self) -> tuple[Any, dict[str, Any]]:
        upload = self.state.get("upload")
        if not upload:
            raise InvalidArgumentError("no upload in progress: send UPLOAD_BEGIN first")
        if self._part is None:
            self._part = open(  # noqa: SIM115 - held across chunks, closed by _close_part
                self.root / upload["target"] / f"{upload['slot']}.part", "ab", buffering=0
            )
        return self._part, upload

    def _close_part(self) -> None:
        if self._part is not None:
            self._part.close()
            self._part = None

    def chunk(self, offset: int, data: bytes | memoryview, crc: int) -> int:
        """Append one chunk; the next offset."""
        f, upload = self._part_file()
        at = f.tell()
        if crc32(data) != crc:
            raise ChunkError(f"chunk at {offset} failed its CRC; resend from {at}")
        if offset != at:
            raise ChunkError(f"chunk at {offset} is out of place; resend from {at}")
        if at + len(data) > upload["size"]:
            raise InvalidArgumentError("chunk runs past the announced image size")
        self._write(f, data)
        return at + len(data)

    def end(self) -> bytes:
        """Check the finished upload in full and keep it in its slot; the image digest."""
        _f, upload = self._part_file()
        self._close_part()
        target, slot = upload["target"], upload["slot"]
        part = self.root / target / f"{slot}.part"
        if part.stat().st_size != upload["size"]:
            raise InvalidArgumentError(
                f"upload incomplete: {part.stat().st_size} of {upload['size']} bytes"
            )
        h = hashlib.sha256()
        with open(part, "rb") as r:
            while block := r.read(1 << 22):
                h.update(block)
        try:
            if h.hexdigest() != upload["digest"]:
                raise ImageError("the uploaded bytes do not match the announced SHA-256")
            image = open_image(part, verify=True, trusted_keys=self.trusted_keys)
            image.close()
        except ImageError:
            part.unlink(missing_ok=True)
            self.state["upload"] = None
            self._drop_empty(target)
            self._save()
            raise
        entry = self.state["targets"][target]
        if slot in (entry.get("confirmed"), entry.get("testing")):  # never replace what serves
            self._drop_upload()
            self._save()
            raise InvalidArgumentError(f"slot {slot} of {target!r} serves now; flash again")
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        if slot in entry["slots"]:  # 1. forget the old image: nothing may roll back to it now
            del entry["slots"][slot]
            if entry.get("previous") == slot:
                entry["previous"] = None
            self._save()
        os.replace(part, self.path(target, slot))  # 2. the verified bytes take its place
        self._fsync_dir(self.root / target)
        if slot in self.damaged.get(target, ()):
            self.damaged[target].remove(slot)
        entry["slots"][slot] = {  # 3. and are recorded
            "digest": upload["digest"],
            "version": upload["version"],
            "size": upload["size"],
        }
        self.state["upload"] = None
        self._save()
        return bytes.fromhex(upload["digest"])

    def _drop_empty(self, target: str) -> None:
        entry = self.state["targets"].get(target)
        if entry is not None and not entry["slots"]:
            del self.state["targets"][target]
            for p in (self.root / target).glob("*"):
                p.unlink()
            with contextlib.suppress(OSError):
                (self.root / target).rmdir()

    def _held_targets(self) -> list[str]:
        """Targets that hold an image (an upload's new, empty target does not count)."""
        return [name for name, entry in self.state["targets"].items() if entry["slots"]]

    def _roles_changed(self, target: str) -> None:
        """After a slot changed roles: a partial upload into a slot that now serves or is the
        rollback target is dropped (the next flash starts again in the right slot)."""
        upload = self.state.get("upload")
        entry = self.state["targets"][target]
        if upload and upload["target"] == target and upload["slot"] != _upload_slot(entry):
            self._drop_upload()

    # ------------------------------------------------------------------ slots

    def activate(self, target: str) -> Path:
        """Put the verified image that is not serving on trial; its path."""
        entry = self._target(target)
        candidates = [
            s
            for s in SLOTS
            if s in entry["slots"] and s != entry.get("confirmed") and s != entry.get("previous")
        ]
        if not candidates:
            raise InvalidArgumentError(f"target {target!r} has no new verified image to activate")
        entry["testing"] = candidates[0]
        self._roles_changed(target)
        self._save()
        return self.path(target, candidates[0])

    def confirm(self, target: str) -> None:
        entry = self._target(target)
        if not entry.get("testing"):
            raise InvalidArgumentError(f"target {target!r} has no image on trial to confirm")
        entry["previous"], entry["confirmed"] = entry.get("confirmed"), entry["testing"]
        entry["testing"] = None
        self._roles_changed(target)
        self._save()

    def revert(self, target: str) -> Path | None:
        """Drop the image on trial, or go back to the previous confirmed image; the path that
        now serves (None if nothing does)."""
        entry = self._target(target)
        previous = entry.get("previous")
        if entry.get("testing"):
            entry["testing"] = None
        elif previous and previous in entry["slots"] and self._intact(target, previous):
            entry["confirmed"], entry["previous"] = previous, entry["confirmed"]
        else:
            raise InvalidArgumentError(f"target {target!r} has no verified image to revert to")
        self._roles_changed(target)
        self._save()
        slot = entry.get("confirmed")
        return self.path(target, slot) if slot else None

    def erase(self, target: str) -> None:
        if target not in self.state["targets"] and target not in self.damaged:
            self._target(target)  # raises
        upload = self.state.get("upload")
        if upload and upload["target"] == target:
            self._close_part()
            self.state["upload"] = None
        self.state["targets"].pop(target, None)
        self.damaged.pop(target, None)
        self._save()
        for p in (self.root / target).glob("*"):
            p.unlink()
        with contextlib.suppress(OSError):
            (self.root / target).rmdir()
