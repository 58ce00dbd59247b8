from __future__ import annotations

from pathlib import Path

import pytest

from exstill_sdk.image.pack import pack_checkpoint

from .checkpoints import save_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("llama") / "ckpt", "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("qwen3") / "ckpt", "qwen3", tie=True)


@pytest.fixture(scope="session")
def small_image(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> bytes:
    """The bytes of a valid f16 image (for mutation tests)."""
    path = tmp_path_factory.mktemp("img") / "small.img"
    pack_checkpoint(qwen3_dir, path, "tiny-qwen3", "f16")
    return path.read_bytes()
