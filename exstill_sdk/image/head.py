"""A frequency-ranked head cut from an image that has the whole vocabulary's: the same weights,
with the output projection's rows (the embedding's, when tied) kept for the given ids only.

``exstill-bench engine --head`` times a draft with and without one this way, and it serves
anyone who wants a smaller head on an image already packed (pack.py makes one from a
checkpoint: ``pack_checkpoint(head_ids=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from exstill_sdk.errors import ImageError
from exstill_sdk.image.pack import check_head_ids, tensor_specs
from exstill_sdk.image.reader import HEAD_IDS, CardImage
from exstill_sdk.image.writer import ImageWriter, WrittenImage


def cut_head(image: CardImage, head_ids: Sequence[int], output: str | Path) -> WrittenImage:
    """Write ``image`` with a head of ``head_ids`` to ``output`` (unsigned)."""
    arch = image.arch
    if arch.head_size:
        raise ImageError(f"image {image.target!r} has a head already ({arch.head_size} tokens)")
    ids = check_head_ids(head_ids, arch.vocab_size)
    config = replace(arch, head_size=len(ids))
    metadata = {k: v for k, v in image.metadata.items() if not k.startswith("arch.")}
    metadata.update(config.to_metadata())
    metadata[HEAD_IDS] = ids
    source = "embed.weight" if arch.tie_embeddings else "lm_head.weight"
    rows = np.array(ids, np.int64)
    specs = tensor_specs(config, image.quant)
    with ImageWriter(output, metadata, specs) as writer:
        for spec in specs:
            if spec.name.startswith("lm_head.weight"):
                writer.write(
                    spec.name, image.tensor(spec.name.replace("lm_head.weight", source))[rows]
                )
            else:
                writer.write(spec.name, image.tensor(spec.name))
        return writer.finish()
