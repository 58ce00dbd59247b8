"""Function-preserving expansion: the expanded model computes the small one's function."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.demo import demo_dir, demo_target
from exstill_sdk.demo.pair import held_out_prompts
from exstill_sdk.errors import ImageError
from exstill_sdk.image import open_image
from exstill_sdk.image.expand import Widths, expand_image, expanded_config, parameter_count


def _logits(image: object, ids: list[int]) -> np.ndarray:
    target = OnnxTarget(image, positions=512, threads=1)  # type: ignore[arg-type]
    return target.runner.prefill(0, np.asarray(ids, np.int64), 0, last=len(ids))


@pytest.fixture(scope="module")
def texts() -> list[list[int]]:
    return held_out_prompts(2, 300)


def test_the_large_demo_target_writes_the_small_targets_text(
    demo_cache: Path, texts: list[list[int]]
) -> None:
    small, large = demo_target("small"), demo_target("large")
    assert large.parameters >= 100_000_000 and large.image.data_size >= 400_000_000
    meta = large.image.metadata
    assert meta["tokenizer.sha256"] == small.image.metadata["tokenizer.sha256"]
    assert meta["quant.dtype"] == "f32" and meta["arch.tie_embeddings"] is False
    for ids in texts:
        a, b = _logits(small.image, ids), _logits(large.image, ids)
        assert np.abs(a - b).max() < 1e-4  # every position of 300 held-out tokens
        assert (a.argmax(-1) == b.argmax(-1)).all()
    prompt = texts[0][:96]
    greedy_small = OnnxTarget(small.image, positions=512).greedy(prompt, 48)
    assert OnnxTarget(large.image, positions=512).greedy(prompt, 48) == greedy_small


def test_no_expanded_matrix_is_mostly_zeros(demo_cache: Path) -> None:
    image = demo_target("large").image
    for name, info in image.tensors.items():
        if len(info.shape) == 2:
            assert np.count_nonzero(image.tensor(name)) > 0.99 * np.prod(info.shape), name


def test_any_width_preserves_the_function(tmp_path: Path, texts: list[list[int]]) -> None:
    small = open_image(demo_dir() / "target.img")
    widths = Widths(hidden_size=320, num_kv_heads=3, intermediate_size=800)  # uneven splits
    out = tmp_path / "w320.img"
    calls: list[int] = []
    written = expand_image(small, out, widths, target="w320", seed=5, progress=calls.append)
    assert sum(calls) == 4 * parameter_count(expanded_config(small.arch, widths))
    expanded = open_image(out, verify=True)
    assert expanded.content_sha256 == written.content_sha256 and expanded.arch.num_heads == 6
    ids = texts[1][:120]
    assert np.abs(_logits(small, ids) - _logits(expanded, ids)).max() < 1e-4


def test_expansion_is_deterministic_and_refuses_to_shrink(tmp_path: Path) -> None:
    small = open_image(demo_dir() / "target.img")
    widths = Widths.scaled(small.arch, 384)
    a = expand_image(small, tmp_path / "a.img", widths, target="a")
    b = expand_image(small, tmp_path / "b.img", widths, target="a")
    assert a.content_sha256 == b.content_sha256
    with pytest.raises(ValueError, match="below the source"):
        expanded_config(small.arch, Widths(128, 2, 768))


def test_a_damaged_cache_entry_is_rebuilt(demo_cache: Path) -> None:
    before = demo_target("large").image
    path, digest = before.path, before.content_sha256
    before.close()
    assert path is not None and path.is_relative_to(demo_cache)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ImageError):
        open_image(path, verify=True)
    rebuilt = demo_target("large").image
    rebuilt.verify()  # raises if the digest does not hold
    assert (
        rebuilt.content_sha256 == digest
    )  # the same bytes as the first build: it is deterministic
