"""Upload speed of exstill-flash, and the bytes a resumed upload sends twice.

Builds an image of about ``size_mb`` MB (a synthetic Llama draft), flashes it to the card at
``url`` (which needs an image store: exstill-emu --store DIR), then flashes it again to a fresh
target name with the link cut halfway, reporting what the resume re-sent.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from exstill_sdk.card import open_card
from exstill_sdk.flash import flash


def _image(root: Path, size_mb: int) -> Path:
    from exstill_sdk.harness.synthetic import write_checkpoint
    from exstill_sdk.image.pack import pack_checkpoint

    hidden = 512
    vocab = max(1024, int(size_mb * 1e6 / (2 * hidden * 4)))  # embeddings dominate
    write_checkpoint(
        root / "ckpt", layers=1, hidden=hidden, intermediate=1024, heads=8, kv_heads=4, vocab=vocab
    )
    path = root / "bench.img"
    pack_checkpoint(root / "ckpt", path, "bench")
    return path


def run(url: str, size_mb: int = 256, key: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="exstill-bench-flash-") as tmp:
        image = _image(Path(tmp), size_mb)
        size = image.stat().st_size
        with open_card(url, timeout=60, key=key) as card:
            first = flash(card, image, target="bench-a", allow_downgrade=True, health_check=False)
            cut = [size // 2]

            def drop(offset: int) -> None:
                if cut and offset >= cut[0]:
                    cut.clear()
                    card.transport.interrupt()

            resumed = flash(
                card,
                image,
                target="bench-b",
                allow_downgrade=True,
                health_check=False,
                on_chunk=drop,
            )
            card.erase("bench-a")
            card.erase("bench-b")
    return {
        "url": url,
        "image_bytes": size,
        "mb_per_s": round(first.mb_per_s, 1),
        "upload_s": round(first.upload_s, 3),
        "resumed_mb_per_s": round(resumed.mb_per_s, 1),
        "resumed_from": resumed.resumed_from,
        "resent_bytes": resumed.resent_bytes,
        "window_chunks": 16,
    }
