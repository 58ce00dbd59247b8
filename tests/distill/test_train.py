"""The rank temperature ``exstill distill`` packs (distill/train.py ``rank_temperature``): fitted
on the draft's softmax over its head alone, it equals the fit over the packed image's own
logits, and the image carries it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exstill_sdk.distill.data import Example  # noqa: E402
from exstill_sdk.distill.train import answer_logits, rank_temperature  # noqa: E402
from exstill_sdk.image import open_image  # noqa: E402
from exstill_sdk.image.hf import to_hf_model  # noqa: E402
from exstill_sdk.image.pack import pack_checkpoint  # noqa: E402
from exstill_sdk.support.calibration import RANK_GRID, RankTemperatureFit  # noqa: E402

from ..image.checkpoints import VOCAB, save_model  # noqa: E402

HEAD = sorted({*range(3), *range(5, VOCAB, 2)})  # 48 tokens: the specials and odd ids


def examples(model, count: int = 12) -> list[Example]:
    """Prompts with the model's own greedy answers, its top-4 tokens at each answer position."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(count):
        prompt = rng.integers(3, VOCAB, 8).tolist()
        ids = torch.tensor([prompt])
        answer = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0], -1)
        top = logp[len(prompt) - 1 : -1].topk(4)
        out.append(
            Example(
                np.array(prompt + answer, np.int32),
                len(prompt),
                top.indices.numpy().astype(np.int32),
                top.values.numpy().astype(np.float16),
            )
        )
    return out


def test_the_fit_over_the_head_is_the_fit_over_the_packed_images_logits(tmp_path: Path) -> None:
    import transformers as tf

    directory = save_model(tmp_path / "draft", "llama", scale=0.5)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    target = save_model(tmp_path / "target", "llama", scale=0.5, seed=1)
    teacher = tf.AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager").eval()
    answers = examples(teacher)
    fitted = rank_temperature(model, answers, HEAD)
    assert fitted in {round(t, 3) for t in RANK_GRID}
    pack_checkpoint(directory, tmp_path / "h.img", "tiny", head_ids=HEAD, rank_temperature=fitted)
    with open_image(tmp_path / "h.img") as image:
        assert image.rank_temperature == fitted
        card = to_hf_model(image)  # minus infinity outside the head, as the card's graph
    fit = RankTemperatureFit()
    for logits, best in answer_logits(card, answers):
        fit.add(logits.numpy(), best)
    outside = sum(int(np.isin(e.top_ids[:, 0], HEAD, invert=True).sum()) for e in answers)
    assert outside > 0 and fit.rows == sum(len(e.top_ids) for e in answers) - outside
    assert fit.best() == fitted
    # without a head every position counts, and the whole softmax is fitted
    whole = RankTemperatureFit()
    for logits, best in answer_logits(model, answers):
        whole.add(logits.numpy(), best)
    assert rank_temperature(model, answers, None) == whole.best()
    assert whole.rows == sum(len(e.top_ids) for e in answers)
