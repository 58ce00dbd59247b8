"""Building an emulated card from options: its engines from names and image files, its image
store, its runtime. One place for exstill-emu and the in-process emu:// link, with one set of
defaults."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from exstill_sdk.errors import ImageError
from exstill_sdk.image import load_trusted_keys, open_image

from ..engines import DraftEngine, builtin_engine
from ..runtime import DEFAULT_CONTEXT, DEFAULT_MAX_K, DEFAULT_SLOTS

if TYPE_CHECKING:
    from ..runtime import CardRuntime


@dataclass(frozen=True)
class CardOptions:
    """What an emulated card is started with; the defaults are a card's."""

    slots: int = DEFAULT_SLOTS
    context: int = DEFAULT_CONTEXT
    engines: tuple[str, ...] = ("lookup",)
    images: tuple[str, ...] = ()
    """Card images loaded as targets (checked in full first)."""
    max_k: int = DEFAULT_MAX_K
    prefetch: bool = True
    prefetch_outcomes: bool = True
    """Draft ahead for other verification outcomes too, not only full acceptance."""
    threads: int = 0
    """Compute threads per transformer engine (0: one per core)."""
    store: str | None = None
    """Image store directory (flashed targets; survives restarts)."""
    store_max_bytes: int | None = None
    trusted_keys: str | None = None
    """Directory (or file) of trusted *.pub keys: unsigned or foreign images are refused."""
    power_cut_after: int | None = None
    """Fault injection: the store loses power after writing this many bytes."""
    admin_key: bytes | None = field(default=None, repr=False)


def build_runtime(options: CardOptions, *, background_prefetch: bool = True) -> CardRuntime:
    """The card runtime those options describe. ``background_prefetch=False`` for a server that
    runs the prefetch work itself between requests (exstill-emu)."""
    from ..runtime import CardRuntime

    engines = build_engines(
        options.engines,
        options.images,
        options.slots,
        options.context,
        options.trusted_keys,
        threads=options.threads,
    )
    store = None
    if options.store:
        from ..store import Store

        store = Store(
            options.store,
            max_bytes=options.store_max_bytes,
            trusted_keys=load_trusted_keys(options.trusted_keys) if options.trusted_keys else None,
            fault_after_bytes=options.power_cut_after,
        )
    return CardRuntime(
        options.slots,
        options.context,
        engines,
        store=store,
        max_k=options.max_k,
        prefetch=options.prefetch,
        background_prefetch=background_prefetch,
        prefetch_outcomes=options.prefetch_outcomes,
        threads=options.threads,
        admin_key=options.admin_key,
    )


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
    from ..engines.transformer import TransformerEngine  # onnxruntime: only when images are given

    out: list[DraftEngine] = [builtin_engine(name) for name in engines]
    trusted = load_trusted_keys(trusted_keys) if trusted_keys else None
    for path in images:
        image = open_image(path, verify=True, trusted_keys=trusted)
        if any(e.name == image.target for e in out):
            raise ImageError(f"{path}: target {image.target!r} is already loaded")
        out.append(TransformerEngine(image, rows=slots, positions=context, threads=threads))
    return out
