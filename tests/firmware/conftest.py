from __future__ import annotations

from pathlib import Path

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.store import Store

from exstill_sdk.card import Card
from exstill_sdk.harness.synthetic import write_checkpoint
from exstill_sdk.image import generate_keypair, load_private_key, open_image
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.transport.emu import EmuTransport

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


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Versions 1 and 2 of a small target (~0.5 MB: 16 upload chunks), and a signed v3."""
    root = tmp_path_factory.mktemp("flash")
    out = {}
    keys = root / "keys"
    generate_keypair(keys, "vendor")
    generate_keypair(keys, "other")
    for version, seed in (("1", 1), ("2", 2), ("3", 3)):
        write_checkpoint(
            root / f"ck{version}",
            layers=1,
            hidden=64,
            intermediate=96,
            heads=4,
            kv_heads=2,
            vocab=1024,
            seed=seed,
            std=0.3,
        )
        key = load_private_key(keys / "vendor.key") if version == "3" else None
        out[version] = root / f"v{version}.img"
        pack_checkpoint(
            root / f"ck{version}", out[version], "tiny", image_version=version, signing_key=key
        )
    out["keys"] = keys
    return out


def card_on(store: Store) -> Card:
    runtime = CardRuntime(4, 256, store=store, prefetch=False)
    return Card(EmuTransport(runtime, owns_runtime=True))


def serving_version(root: Path, target: str = "tiny") -> str:
    store = Store(root)
    path = store.serving()[target]
    with open_image(path, verify=True) as image:
        return image.image_version
