"""Packing: an HF checkpoint directory or a GGUF file in, a card image out (what
``exstill-pack`` runs)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from exstill_sdk.errors import CheckpointError
from exstill_sdk.image.arch import DecoderConfig
from exstill_sdk.image.checkpoint import Checkpoint, read_checkpoint
from exstill_sdk.image.format import MAX_ARRAY_ITEMS, DType
from exstill_sdk.image.gguf_file import GgufCheckpoint, is_gguf, read_gguf
from exstill_sdk.image.quantize import quantize_rows
from exstill_sdk.image.reader import HEAD_IDS, RANK_TEMPERATURE, RANK_TEMPERATURES
from exstill_sdk.image.tokenizer import fingerprint_to_metadata
from exstill_sdk.image.writer import ImageWriter, TensorSpec, WrittenImage

DTYPES = ("f32", "f16", "int8")
_MATRIX_DTYPE = {"f32": DType.F32, "f16": DType.F16, "int8": DType.I8}
F16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class PackResult:
    image: WrittenImage
    target: str
    dtype: str
    tensors: int
    parameters: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.image.path),
            "target": self.target,
            "dtype": self.dtype,
            "size": self.image.size,
            "tensors": self.tensors,
            "parameters": self.parameters,
            "content_sha256": self.image.content_sha256.hex(),
            "file_sha256": self.image.file_sha256.hex(),
            "signed": self.image.key_id is not None,
            "key_id": self.image.key_id.hex() if self.image.key_id else None,
            "seconds": round(self.seconds, 3),
        }


def read_source(
    source: str | Path, tokenizer: str | Path | None = None
) -> Checkpoint | GgufCheckpoint:
    """What a checkpoint path names: a GGUF file (it carries its own tokenizer) or an HF
    checkpoint directory."""
    if is_gguf(source):
        if tokenizer is not None:
            raise CheckpointError(
                "a GGUF file carries its tokenizer; --tokenizer is for checkpoint directories"
            )
        return read_gguf(source)
    return read_checkpoint(source, tokenizer)


def tensor_specs(config: DecoderConfig, dtype: str) -> list[TensorSpec]:
    """Every tensor an image of ``config`` packed as ``dtype`` holds, in file order."""
    specs = []
    for name, shape in config.tensor_shapes().items():
        if len(shape) == 2:
            specs.append(TensorSpec(name, _MATRIX_DTYPE[dtype], shape))
            if dtype == "int8":
                specs.append(TensorSpec(name + ".scale", DType.F32, shape[:1]))
        else:
            specs.append(TensorSpec(name, DType.F32, shape))
    return specs


def _convert(name: str, value: np.ndarray, dtype: str) -> list[tuple[str, np.ndarray]]:
    """The image tensors for one checkpoint tensor: vectors stay float32; matrices become
    ``dtype`` (int8 adds a per-row scale)."""
    if value.ndim != 2 or dtype == "f32":
        return [(name, np.ascontiguousarray(value, dtype="<f4"))]
    if dtype == "f16":
        if value.dtype != np.float16 and np.abs(value).max(initial=0) > F16_MAX:
            raise CheckpointError(f"{name} has values beyond float16's range; pack as f32")
        return [(name, np.ascontiguousarray(value, dtype="<f2"))]
    q, scale = quantize_rows(value)
    return [(name, q), (name + ".scale", scale)]


def check_head_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """A frequency-ranked head's target ids, as a list; CheckpointError when they are not
    distinct ids of the vocabulary or too many for an image."""
    out = [int(i) for i in ids]
    if not 1 <= len(out) <= min(vocab_size, MAX_ARRAY_ITEMS):
        raise CheckpointError(
            f"a head must hold 1..{min(vocab_size, MAX_ARRAY_ITEMS)} token ids, not {len(out)}"
        )
    if min(out) < 0 or max(out) >= vocab_size or len(set(out)) != len(out):
        raise CheckpointError(f"head ids must be distinct ids in 0..{vocab_size - 1}")
    return out


def read_head_ids(path: str | Path) -> list[int]:
    """Token ids from a file: a JSON list, or one id a line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CheckpointError(f"cannot read head ids from {path}: {exc.strerror}") from None
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else text.split()
        return [int(i) for i in ids]
    except (ValueError, TypeError):
        raise CheckpointError(
            f"{path} must hold token ids: a JSON list of integers, or one integer a line"
        ) from None


def _tensors(
    ckpt: Checkpoint | GgufCheckpoint, head_ids: list[int] | None
) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """The checkpoint's tensors in file order; with a head, the output projection (the
    embedding, when tied) cut to the head's rows, last."""
    if head_ids is None:
        yield from ckpt.load()
        return
    rows = np.array(head_ids, np.int64)
    source = "embed.weight" if ckpt.config.tie_embeddings else "lm_head.weight"
    head: Callable[[], np.ndarray] | None = None
    for name, load in ckpt.load():
        if name == source:
            head = load
        if name != "lm_head.weight":
            yield name, load
    assert head is not None  # the checkpoint readers check that every tensor is there
    whole = head
    yield "lm_head.weight", lambda: np.asarray(whole())[rows]


def pack_checkpoint(
    source: str | Path,
    output: str | Path,
    target: str,
    dtype: str = "f32",
    *,
    image_version: str = "1",
    signing_key: Ed25519PrivateKey | None = None,
    tokenizer: str | Path | None = None,
    progress: bool = False,
    head_ids: Sequence[int] | None = None,
    rank_temperature: float | None = None,
) -> PackResult:
    """Pack ``source`` into an image for ``target``; with ``head_ids``, the output head keeps
    only those tokens' rows (a frequency-ranked head, docs/image-format.md); with
    ``rank_temperature``, the temperature that calibrates the draft's probabilities (the card
    ranks tree nodes and outcomes by them)."""
    if dtype not in DTYPES:
        raise CheckpointError(
            f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}"
        )
    if not target or len(target.encode()) > 64:
        raise CheckpointError("the target name must be 1..64 bytes")
    low, high = RANK_TEMPERATURES
    if rank_temperature is not None and not low <= rank_temperature <= high:
        raise CheckpointError(f"the rank temperature must be from {low} to {high}")
    start = time.perf_counter()
    ckpt = read_source(source, tokenizer)
    config, ids = ckpt.config, None
    if head_ids is not None:
        ids = check_head_ids(head_ids, config.vocab_size)
        config = replace(config, head_size=len(ids))
    from exstill_sdk.version import __version__

    metadata: dict[str, Any] = {
        "image.target": target,
        "image.version": image_version,
        "image.created_by": f"exstill-pack {__version__}",
        "quant.dtype": dtype,
        **config.to_metadata(),
        **fingerprint_to_metadata(ckpt.tokenizer),
    }
    if ids is not None:
        metadata[HEAD_IDS] = ids
    if rank_temperature is not None:
        metadata[RANK_TEMPERATURE] = float(rank_temperature)
    if dtype == "int8":
        metadata["quant.scheme"] = "symmetric-per-row"
    specs = tensor_specs(config, dtype)
    bar = tqdm(
        total=sum(s.nbytes for s in specs),
        unit="B",
        unit_scale=True,
        desc=f"packing {target}",
        disable=not progress,
        leave=False,
    )
    try:
        with ImageWriter(output, metadata, specs) as writer:  # a failure removes the partial file
            for name, load in _tensors(ckpt, ids):
                for out_name, array in _convert(name, load(), dtype):
                    writer.write(out_name, array)
                    bar.update(array.nbytes)
            written = writer.finish(signing_key)
    finally:
        bar.close()
    parameters = sum(int(np.prod(s.shape)) for s in specs if not s.name.endswith(".scale"))
    return PackResult(written, target, dtype, len(specs), parameters, time.perf_counter() - start)
