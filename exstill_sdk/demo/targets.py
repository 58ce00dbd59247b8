"""The demo's targets: the trained 4.2M-parameter target (``small``) and the same model expanded
to the size at which a step is bound by memory (``large``).

The small target's 17 MB of f32 weights sit inside this kind of CPU's last-level cache, so its
step is bound by arithmetic and scoring 7 tokens costs about 2.4 plain steps: speculation cannot
pay much. A large LLM served on a GPU is bound by reading its weights instead, and so is a CPU
target whose weights are well beyond the cache. ``demo-target-large`` is the small target
expanded (exstill_sdk.image.expand: residual stream rotated into 1536 dimensions, heads and MLP
units split) to 126M parameters, 503 MB of f32: a cost stand-in for a large target that writes
exactly the small target's text, so the shipped draft stays aligned with it. It is built on
first use into the user's cache directory, deterministically, in seconds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exstill_sdk.demo.pair import demo_dir
from exstill_sdk.errors import ImageError, InvalidArgumentError
from exstill_sdk.image.expand import Widths, expand_image, expanded_config, parameter_count
from exstill_sdk.image.reader import CardImage, open_image

EXPANSION_REVISION = 1
"""Bump when expand.py changes what it writes: cached images of another revision are rebuilt."""
LARGE_HIDDEN = 1536
TARGETS = ("large", "small")


@dataclass(frozen=True)
class DemoTarget:
    name: str
    """``small``, ``large``, or ``wN`` for an expansion to hidden size N (benchmarks)."""
    image: CardImage
    """Opened and verified."""
    parameters: int
    description: str


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/exstill``, else ``~/.cache/exstill``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exstill"


def cached_image(
    path: Path, build: Callable[[], object], size: str, stage: Callable[[str], None]
) -> CardImage:
    """The image at ``path`` in the cache, verified; made by ``build`` when it is missing or
    damaged. ``stage`` hears of the check and of the build (``size``: what it writes)."""
    if path.exists():
        stage(f"checking {path.name} ({size}, made on first use)")
        try:
            return open_image(path, verify=True)
        except ImageError:  # a damaged cache entry: make it again
            path.unlink()
    stage(f"making {path} once: {size} to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    build()
    return open_image(path, verify=True)


def _build(source: Path, path: Path, name: str, hidden: int, progress: bool) -> None:
    from tqdm import tqdm

    image = open_image(source)
    widths = Widths.scaled(image.arch, hidden)
    size = 4 * parameter_count(expanded_config(image.arch, widths))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(
        total=size,
        unit="B",
        unit_scale=True,
        desc=f"building {path.name} (once)",
        disable=not progress,
        leave=False,
        file=sys.stderr,
    ) as bar:
        expand_image(image, path, widths, target=name, progress=bar.update)


def expanded_target(
    hidden: int, *, progress: bool = False, on_stage: Callable[[str], None] | None = None
) -> DemoTarget:
    """The small target expanded to ``hidden``, from the cache (built there if missing);
    ``on_stage`` hears of the build and of the check of a cached image before they start."""
    source = demo_dir() / "target.img"
    small = open_image(source)
    name = "demo-target-large" if hidden == LARGE_HIDDEN else f"demo-target-w{hidden}"
    path = cache_dir() / f"{name}-{small.content_sha256.hex()[:12]}-r{EXPANSION_REVISION}.img"
    stage = on_stage or (lambda _: None)
    params = parameter_count(expanded_config(small.arch, Widths.scaled(small.arch, hidden)))
    image = cached_image(
        path,
        lambda: _build(source, path, name, hidden, progress),
        f"{4 * params / 1e6:.0f} MB",
        stage,
    )
    return DemoTarget(
        "large" if hidden == LARGE_HIDDEN else f"w{hidden}",
        image,
        params,
        f"the demo target expanded to {params / 1e6:.0f}M parameters ({4 * params / 1e6:.0f} MB "
        "f32), the size at which a step is bound by memory: a cost stand-in for a large "
        "target, writing the small target's text",
    )


def demo_target(
    name: str, *, progress: bool = False, on_stage: Callable[[str], None] | None = None
) -> DemoTarget:
    """``small`` (the trained target as shipped) or ``large`` (see the module docstring)."""
    if name == "large":
        return expanded_target(LARGE_HIDDEN, progress=progress, on_stage=on_stage)
    if name == "small":
        image = open_image(demo_dir() / "target.img", verify=True)
        params = parameter_count(image.arch)
        return DemoTarget(
            "small",
            image,
            params,
            f"the trained demo target, {params / 1e6:.1f}M parameters (its weights fit in the "
            "CPU's cache: a step is bound by arithmetic)",
        )
    raise InvalidArgumentError(f"unknown demo target {name!r}; choose one of {', '.join(TARGETS)}")


def sized_target(size: str, *, progress: bool = False) -> DemoTarget:
    """``small``, ``large`` or a hidden size (digits) to expand the demo target to."""
    if size in ("small", "large"):
        return demo_target(size, progress=progress)
    return expanded_target(int(size), progress=progress)
