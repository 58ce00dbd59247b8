"""Greedy speculative decoding emits exactly the target's greedy output, token for token:
20 prompts x 64 new tokens, drafts that always, never and partly agree and prompt lookup,
batch 1 and batch 4, with an HF target and with the ONNX target."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exstill_sdk import open_card  # noqa: E402
from exstill_sdk.adapters.hf import HFTarget  # noqa: E402
from exstill_sdk.adapters.onnx import OnnxTarget  # noqa: E402
from exstill_sdk.speculative import SpeculativeDecoder  # noqa: E402

N_NEW = 64


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(42)
    out = []
    for i in range(20):
        base = rng.integers(3, 96, int(rng.integers(3, 12))).tolist()
        # half of them repetitive, so that prompt lookup has something to find
        out.append(base * 3 if i % 2 else base)
    return out


@pytest.fixture(scope="module")
def hf_model(pair):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(pair.target_dir, attn_implementation="eager")


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    out = []
    for p in prompts():
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=N_NEW,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def onnx_reference(pair):
    target = OnnxTarget(pair.target_image, max_sequences=1, positions=512)
    return [target.greedy(p, N_NEW) for p in prompts()]


DRAFTS = ["agree", "never", "partly", "lookup"]


def _decode(card, target, draft: str, batch: int):
    decoder = SpeculativeDecoder(
        card,
        target,
        draft=None if draft == "lookup" else draft,
        k=5,
        trees="off",  # chains: acceptance rates mean what _check_acceptance says (test_tree_rounds)
    )
    results = []
    ps = prompts()
    for i in range(0, len(ps), batch):
        results += decoder.generate_batch(ps[i : i + batch], N_NEW, stop_token_ids=[])
    return results, decoder.metrics


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft", DRAFTS)
def test_hf_target(pair, hf_model, hf_reference, draft: str, batch: int) -> None:
    with open_card(pair.url()) as card:
        results, metrics = _decode(card, HFTarget(hf_model), draft, batch)
    assert [r.tokens for r in results] == hf_reference
    _check_acceptance(draft, metrics)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft", DRAFTS)
def test_onnx_target(pair, onnx_reference, draft: str, batch: int) -> None:
    target = OnnxTarget(pair.target_image, max_sequences=batch, positions=512)
    with open_card(pair.url()) as card:
        results, metrics = _decode(card, target, draft, batch)
    assert [r.tokens for r in results] == onnx_reference
    _check_acceptance(draft, metrics)


def _check_acceptance(draft: str, metrics) -> None:
    rate = metrics.acceptance_rate
    if draft == "agree":
        assert rate == 1.0
    elif draft == "never":
        assert rate < 0.3
    elif draft == "partly":
        assert 0.1 < rate < 1.0
    assert metrics.emitted_tokens == 20 * N_NEW
