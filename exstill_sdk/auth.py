"""The card's admin key: who may change the image store over a network link.

The card sends a fresh random nonce (AUTH_CHALLENGE); the host answers with
HMAC-SHA256(key, AUTH_CONTEXT + nonce) (AUTH; exstill_sdk.protocol.auth). The key never
crosses the wire, each nonce is used once, and a recorded exchange proves nothing on another
connection. A key file holds 32 random bytes as hex, created with mode 0600 and never printed.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from exstill_sdk.errors import InvalidArgumentError

KEY_BYTES = 32


def generate_admin_key(path: str | Path) -> Path:
    """Write a new key to ``path`` (which must not exist), readable by its owner only."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidArgumentError(f"{path} exists; choose another file name") from None
    except OSError as exc:
        raise InvalidArgumentError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return path


def load_admin_key(key: str | Path | bytes) -> bytes:
    """The key's bytes, from a key file (or the bytes themselves)."""
    if isinstance(key, bytes):
        raw = key
    else:
        try:
            text = Path(key).read_text().strip()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the admin key {key}: {exc.strerror}") from None
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
        if len(raw) != KEY_BYTES:
            raise InvalidArgumentError(
                f"{key} is not an admin key file (make one with exstill-flash --new-key FILE)"
            )
    if len(raw) < 16:
        raise InvalidArgumentError("an admin key needs at least 16 bytes")
    return raw
