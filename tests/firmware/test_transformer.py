"""The ONNX transformer engine against HF transformers on the same weights."""

from __future__ import annotations

import copy
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exstill_firmware.engines.base import Sampling  # noqa: E402
from exstill_firmware.engines.transformer import TransformerEngine  # noqa: E402

from exstill_sdk.image import open_image  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)


def generate(model, prompt: list[int], n: int) -> list[int]:
    """HF greedy generation of exactly n tokens (no end-of-sequence stop: drafts do not stop;
    an explicit attention mask, or HF would mask any input token equal to the pad id)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def tokens(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


@pytest.fixture
def engine(model_pair):
    _, image, _ = model_pair
    return TransformerEngine(open_image(image), rows=4, positions=256)


def test_prefill_decode_chunk_rollback_logits(model_pair, engine) -> None:
    model, _, _ = model_pair
    ids = tokens(40)
    # prefill: logits at every position
    got = engine.runner.forward(0, np.array([ids[:30]]), np.array([0]), np.arange(30))
    want = hf_logits(model, ids[:30])
    assert np.allclose(got, want, **TOL) and (got.argmax(-1) == want.argmax(-1)).all()
    assert want.std() > 1.0  # logits are far from flat
    # single-token decode at position 30
    got = engine.runner.forward(0, np.array([[ids[30]]]), np.array([30]), np.array([0]))
    want = hf_logits(model, ids[:31])[-1:]
    assert np.allclose(got, want, **TOL) and got.argmax() == want.argmax()
    # a multi-token chunk at 31..39
    got = engine.runner.forward(0, np.array([ids[31:40]]), np.array([31]), np.arange(9))
    want = hf_logits(model, ids[:40])[31:]
    assert np.allclose(got, want, **TOL) and (got.argmax(-1) == want.argmax(-1)).all()
    # rollback to 20 is a length change: new tokens overwrite positions 20..
    other = tokens(10, seed=1)
    got = engine.runner.forward(0, np.array([other]), np.array([20]), np.arange(10))
    want = hf_logits(model, ids[:20] + other)[20:]
    assert np.allclose(got, want, **TOL) and (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_drafts_equal_generate(model_pair, engine) -> None:
    model, _, _ = model_pair
    for seed in range(3):
        prompt = tokens(12, seed=10 + seed)
        state = engine.open_state(256, Sampling())
        state.extend(struct.pack(f"<{len(prompt)}I", *prompt))
        draft = unpack(state.propose(8).tokens)
        assert draft == generate(model, prompt, 8)
        # commit a prefix + bonus, draft again: still what HF would generate next
        committed = [*draft[:3], 5]
        state.extend(struct.pack("<4I", *committed))
        assert unpack(state.propose(6).tokens) == generate(model, prompt + committed, 6)
        state.close()


def test_batched_drafts_equal_single_stream_drafts(engine) -> None:
    prompts = [tokens(5 + 3 * i, seed=20 + i) for i in range(4)]
    states = []
    for p in prompts:
        s = engine.open_state(256, Sampling())
        s.extend(struct.pack(f"<{len(p)}I", *p))
        states.append(s)
    batched = engine.propose_many([(s, 6, b"") for s in states])
    singles = [s.propose(6) for s in states]
    assert [p.tokens for p in batched] == [p.tokens for p in singles]
    assert [s.row for s in states] == [0, 1, 2, 3]


def test_seeded_sampling_is_reproducible_and_exact_on_the_wire(model_pair) -> None:
    _, image, _ = model_pair
    sampling = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=1234, max_entries=255)
    runs = []
    for _ in range(2):
        engine = TransformerEngine(open_image(image), rows=2, positions=128)
        state = engine.open_state(128, sampling)
        state.extend(struct.pack("<5I", *tokens(5)))
        proposal = state.propose(8)
        runs.append(proposal)
        for tok, dist in zip(unpack(proposal.tokens), proposal.dists, strict=True):
            assert tok in dist.tokens and len(dist.tokens) <= 20 and all(dist.weights)
    assert runs[0] == runs[1]
    # drafting ahead on a branch gives what drafting after committing that branch gives
    engine = TransformerEngine(open_image(image), rows=2, positions=128)
    a = engine.open_state(128, sampling)
    a.extend(struct.pack("<5I", *tokens(5)))
    ahead = a.propose(4, runs[0].tokens[:12])
    a.extend(runs[0].tokens[:12])
    assert a.propose(4) == ahead


def test_rollback_and_cache_reuse(model_pair, engine) -> None:
    model, _, _ = model_pair
    prompt = tokens(10, seed=3)
    state = engine.open_state(256, Sampling())
    state.extend(struct.pack(f"<{len(prompt)}I", *prompt))
    first = unpack(state.propose(5).tokens)
    state.truncate(6)
    again = unpack(state.propose(5).tokens)
    assert again == generate(model, prompt[:6], 5)
    assert len(first) == 5


def test_int8_product_bound() -> None:
    """Each int8 product (the engine's weight layout, int8 compute) is within the documented
    bound of the exact product with the dequantised weights: sum over blocks b of
    max|x_b| / 254 * sum_{j in b} |W_ij| (activations rounded to int8 per block)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from exstill_sdk.execution.graph import INT8_BLOCK, int8_attributes, int8_blocks

    rng = np.random.default_rng(0)
    for _ in range(20):
        n, k = int(rng.integers(4, 200)), int(rng.choice([32, 48, 64, 100, 256]))
        q = rng.integers(-127, 128, (n, k)).astype(np.int8)
        scale = ((rng.random(n) + 0.1) / 127).astype(np.float32)
        packed, scales = int8_blocks(q, scale)
        node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], **int8_attributes((n, k)))
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
            [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")],
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        x = (rng.standard_normal((3, k)) * rng.choice([0.01, 1.0, 100.0])).astype(np.float32)
        w = q.astype(np.float64) * scale[:, None]
        exact = x.astype(np.float64) @ w.T
        bound = np.zeros_like(exact)
        for start in range(0, k, INT8_BLOCK):
            block = slice(start, start + INT8_BLOCK)
            step = np.abs(x[:, block]).max(-1, keepdims=True).astype(np.float64) / 254
            bound += step @ np.abs(w[:, block]).sum(-1)[None, :]
        got = session.run(None, {"x": x})[0]
        assert (np.abs(got - exact) <= bound * 1.01 + 1e-6).all()


def test_int8_image_drafts_like_its_dequantised_model(model_pair, tmp_path) -> None:
    """Through a whole model the int8 engine's greedy choice agrees with the HF model on the
    dequantised weights at most positions (activation rounding can flip near-ties)."""
    from exstill_sdk.image.checkpoint import image_name
    from exstill_sdk.image.pack import pack_checkpoint
    from exstill_sdk.image.quantize import dequantize_rows

    shared, _, directory = model_pair
    model = copy.deepcopy(shared)  # the session's model stays as it was for later tests
    pack_checkpoint(directory, tmp_path / "q.img", "q", "int8")
    image = open_image(tmp_path / "q.img")
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            name = image_name(hf_name)
            if name is not None and param.ndim == 2 and name in image.tensors:
                deq = dequantize_rows(image.tensor(name), image.tensor(name + ".scale"))
                param.copy_(torch.from_numpy(deq))
    engine = TransformerEngine(image, rows=1, positions=64)
    ids = tokens(20, seed=5)
    got = engine.runner.forward(0, np.array([ids]), np.array([0]), np.arange(20))
    want = hf_logits(model, ids)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.85
