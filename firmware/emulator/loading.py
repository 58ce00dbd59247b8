"""Building an emulated card's engines from names and image files (shared by exstill-emu and
the in-process emu:// link)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from exstill_sdk.errors import ImageError
from exstill_sdk.image import load_trusted_keys, open_image

from ..engines import DraftEngine, builtin_engine
from ..engines.transformer import TransformerEngine


def build_engines(
    engines: Iterable[str],
    images: Iterable[str | Path],
    slots: int,
    context: int,
    trusted_keys: str | Path | None = None,
    threads: int = 0,
) -> list[DraftEngine]:
    """Built-in engines by name, then one transformer engine per image. Every image is checked
    in full (digest, and signature when trusted keys are given) before it is used, as a card
    does; two images for the same target are refused. ``threads`` is the compute threads each
    transformer engine may use (0: onnxruntime's default, one per core)."""
    out: list[DraftEngine] = [builtin_engine(name) for name in engines]
    trusted = load_trusted_keys(trusted_keys) if trusted_keys else None
    for path in images:
        image = open_image(path, verify=True, trusted_keys=trusted)
        if any(e.name == image.target for e in out):
            raise ImageError(f"{path}: target {image.target!r} is already loaded")
        out.append(TransformerEngine(image, rows=slots, positions=context, threads=threads))
    return out
