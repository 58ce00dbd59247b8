from __future__ import annotations

from pathlib import Path

import pytest

from exstill_sdk.image import open_image
from exstill_sdk.image.pack import pack_checkpoint

from ..image.checkpoints import save_model

FAMILIES = {"llama": ("llama", False), "qwen3": ("qwen3", True)}


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def model_pair(request, tmp_path_factory: pytest.TempPathFactory):
    """(HF model in eval mode, f32 image path, checkpoint dir) for Llama (untied) and Qwen3
    (tied, q/k norm); weights rescaled so logits are far from flat."""
    import torch
    import transformers as tf

    family, tie = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"engine-{family}")
    directory = save_model(root / "ckpt", family, tie=tie, scale=0.35)
    image = root / "model.img"
    pack_checkpoint(directory, image, f"tiny-{family}", "f32")
    model = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    model.eval()
    torch.manual_seed(0)
    return model, image, directory


def open_checked(path: Path):
    return open_image(path, verify=True)
