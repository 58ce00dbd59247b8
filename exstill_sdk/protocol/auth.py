"""The AUTH exchange's one computation, shared by the host and the card: the answer to a
challenge (docs/protocol.md, "Admin key"). Key files are exstill_sdk.auth's."""

from __future__ import annotations

import hashlib
import hmac

from exstill_sdk.protocol.constants import AUTH_CONTEXT


def answer(key: bytes, nonce: bytes) -> bytes:
    """The AUTH payload that proves ``key`` for this ``nonce``: HMAC-SHA256(key, AUTH_CONTEXT +
    nonce)."""
    return hmac.new(key, AUTH_CONTEXT + nonce, hashlib.sha256).digest()
