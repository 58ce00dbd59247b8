from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from exstill_sdk.image.pack import pack_checkpoint


@dataclass
class Pair:
    target_dir: Path
    target_image: Path
    drafts: dict[str, Path]  # card target name -> image

    def url(self, context: int = 512, streams: int = 12) -> str:
        images = ",".join(str(p) for p in self.drafts.values())
        return f"emu://?image={images}&context={context}&streams={streams}"


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """A tiny Llama target and three drafts for it: the same weights (always agrees), random
    weights (never), and the target's weights with noise (partly)."""
    pytest.importorskip("torch")
    from ..image.checkpoints import save_model

    root = tmp_path_factory.mktemp("spec")
    target = save_model(root / "target", "llama", scale=0.35)
    random = save_model(root / "random", "llama", scale=0.35, seed=7)
    perturbed = save_model(root / "perturbed", "llama", scale=0.01, seed=3, base=target)
    images = {}
    for name, directory in (("agree", target), ("never", random), ("partly", perturbed)):
        images[name] = root / f"{name}.img"
        pack_checkpoint(directory, images[name], name)
    return Pair(target, images["agree"], images)
