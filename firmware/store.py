"""The card's image store: several targets, two slots each, power-cut safe.

Layout under the store root: ``journal.json`` (the state below) and, per target, ``a.img`` /
``b.img`` and the upload in progress ``<slot>.part``. Invariants that make a power cut at any
byte harmless:

- an upload only ever writes the slot that is not serving, as ``<slot>.part``, sequentially; the
  resume offset is that file's size (the host re-sends from there);
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
    StoreFullError,
    UnknownModelError,
)
from exstill_sdk.image import open_image
from exstill_sdk.image.signing import TrustedKeys
from exstill_sdk.protocol.constants import ImageState

SLOTS = ("a", "b")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
        journal = self.root / "journal.json"
        self.state: dict[str, Any] = (
            json.loads(journal.read_text()) if journal.exists() else {"targets": {}, "upload": None}
        )
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

    def _save(self) -> None:
        tmp = self.root / "journal.json.tmp"
        with open(tmp, "wb") as f:
            self._write(f, json.dumps(self.state, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "journal.json")

    def _boot(self) -> None:
        """Drop an unconfirmed trial image: after a reset the confirmed image serves."""
        changed = False
        for entry in self.state["targets"].values():
            if entry.get("testing"):
                entry["testing"] = None
                changed = True
        if changed:
            self._save()

    # ------------------------------------------------------------------ queries

    def _target(self, name: str) -> dict[str, Any]:
        entry = self.state["targets"].get(name)
        if entry is None:
            raise UnknownModelError(f"the store has no target {name!r}")
        return entry

    def path(self, target: str, slot: str) -> Path:
        return self.root / target / f"{slot}.img"

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
        if entry is None and len(self.state["targets"]) >= self.MAX_TARGETS:
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
        if upload is not None and (upload["target"], upload["digest"], upload["size"]) == (
            target,
            digest.hex(),
            size,
        ):
            part = self.root / target / f"{upload['slot']}.part"
            return part.stat().st_size if part.exists() else 0
        self._close_part()
        if upload:  # another upload was in progress: it is abandoned
            (self.root / upload["target"] / f"{upload['slot']}.part").unlink(missing_ok=True)
        if entry is None:
            entry = {"slots": {}, "confirmed": None, "testing": None, "previous": None}
            self.state["targets"][target] = entry
        slot = "b" if entry.get("confirmed") == "a" else "a"
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
        os.replace(part, self.path(target, slot))
        entry = self.state["targets"][target]
        entry["slots"][slot] = {
            "digest": upload["digest"],
            "version": upload["version"],
            "size": upload["size"],
        }
        if entry.get("previous") == slot:
            entry["previous"] = None
        self.state["upload"] = None
        self._save()
        return bytes.fromhex(upload["digest"])

    def _drop_empty(self, target: str) -> None:
        entry = self.state["targets"].get(target)
        if entry is not None and not entry["slots"]:
            del self.state["targets"][target]

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
        self._save()
        return self.path(target, candidates[0])

    def confirm(self, target: str) -> None:
        entry = self._target(target)
        if not entry.get("testing"):
            raise InvalidArgumentError(f"target {target!r} has no image on trial to confirm")
        entry["previous"], entry["confirmed"] = entry.get("confirmed"), entry["testing"]
        entry["testing"] = None
        self._save()

    def revert(self, target: str) -> Path | None:
        """Drop the image on trial, or go back to the previous confirmed image; the path that
        now serves (None if nothing does)."""
        entry = self._target(target)
        if entry.get("testing"):
            entry["testing"] = None
        elif entry.get("previous"):
            entry["confirmed"], entry["previous"] = entry["previous"], entry["confirmed"]
        else:
            raise InvalidArgumentError(f"target {target!r} has nothing to revert to")
        self._save()
        slot = entry.get("confirmed")
        return self.path(target, slot) if slot else None

    def erase(self, target: str) -> None:
        self._target(target)
        upload = self.state.get("upload")
        if upload and upload["target"] == target:
            self._close_part()
            self.state["upload"] = None
        del self.state["targets"][target]
        self._save()
        for p in (self.root / target).glob("*"):
            p.unlink()
        (self.root / target).rmdir()
