"""Streams on a target image through the whole stack: Card, protocol, runtime, engine."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

from exstill_firmware import CardRuntime  # noqa: E402
from exstill_firmware.emulator import build_engines  # noqa: E402

from exstill_sdk import (  # noqa: E402
    ContextFullError,
    ImageError,
    InvalidArgumentError,
    UnknownModelError,
    WireMode,
    open_card,
)
from exstill_sdk.protocol.drafts import Verdict  # noqa: E402

from ..helpers import served  # noqa: E402
from .test_transformer import generate, tokens  # noqa: E402


def test_target_stream_drafts_what_the_model_generates(model_pair) -> None:
    model, image, _ = model_pair
    target = f"tiny-{model.config.model_type}"
    with open_card(f"emu://?image={image}&context=256&streams=3") as card:
        info = card.info()
        assert info.engines == ("lookup",)
        (t,) = info.targets
        assert t.name == target and t.vocab_size == 96 and any(t.tokenizer_sha256)
        with card.open_stream(target=target) as s:
            prompt = tokens(10, seed=7)
            s.prefill(prompt)
            d = s.draft(5)
            assert list(d.tokens) == generate(model, prompt, 5)
            d2 = s.commit(Verdict(2, 9), 5)
            assert list(d2.tokens) == generate(model, prompt + list(d.tokens[:2]) + [9], 5)
        # a lookup stream and a target stream side by side
        with card.open_stream("lookup") as lk, card.open_stream(target=target) as tg:
            lk.prefill([1, 2, 3, 1, 2])
            tg.prefill(tokens(4))
            assert lk.draft(2).tokens == (3, 1)
            assert len(tg.draft(3).tokens) == 3


def test_sampled_dist_mode_over_the_wire(model_pair) -> None:
    model, image, _ = model_pair
    target = f"tiny-{model.config.model_type}"
    seen = []
    for _ in range(2):
        with open_card(f"emu://?image={image}&context=128") as card:
            s = card.open_stream(
                target=target, temperature=0.8, top_k=16, seed=99, wire_mode=WireMode.DIST
            )
            s.prefill(tokens(6))
            d = s.draft(4)
            assert d.dists is not None and len(d.dists) == 4
            for tok, dist in zip(d.tokens, d.dists, strict=True):
                assert tok in dist.tokens and len(dist.tokens) <= 16
                assert dist.probability(tok) > 0
            seen.append(d.tokens)
    assert seen[0] == seen[1]  # seeded: reproducible


def test_bad_input_is_typed_and_contained(model_pair, tmp_path) -> None:
    model, image, _ = model_pair
    target = f"tiny-{model.config.model_type}"
    with open_card(f"emu://?image={image}&context=64&max_k=8") as card:
        good = card.open_stream(target=target)
        good.prefill(tokens(5))
        with pytest.raises(UnknownModelError):
            card.open_stream(target="not-loaded")
        s = card.open_stream(target=target)
        with pytest.raises(InvalidArgumentError):
            s.draft(9)
        s.prefill(tokens(60))
        with pytest.raises(ContextFullError):
            s.card.request(0x12, bytes(4 * 10), s.handle)  # past the slot, no long context
        with pytest.raises(InvalidArgumentError, match="long-context"):
            card.open_stream("lookup", long_context=True)
        first = good.draft(4).tokens
        assert good.draft(4).tokens == first  # unaffected by the others' errors
    # an image whose architecture the engine cannot run: head_dim 8
    bad = tmp_path / "hd8"
    shutil.copytree(model_pair[2], bad)
    config = json.loads((bad / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    (bad / "config.json").write_text(json.dumps(config))
    from ..image.checkpoints import save_model

    directory = save_model(tmp_path / "small-heads", "qwen3")
    config = json.loads((directory / "config.json").read_text())
    assert config["head_dim"] == 16
    import transformers as tf

    cfg = tf.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
    )
    tf.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "hd8ckpt")
    shutil.copy(directory / "tokenizer.json", tmp_path / "hd8ckpt" / "tokenizer.json")
    from exstill_sdk.image.pack import pack_checkpoint

    pack_checkpoint(tmp_path / "hd8ckpt", tmp_path / "hd8.img", "hd8")
    with pytest.raises(ImageError, match="head_dim 8"):
        build_engines([], [tmp_path / "hd8.img"], 1, 64)


def test_prefetch_hits_over_tcp_and_batches_streams(model_pair) -> None:
    """Over a link the card drafts ahead while the host verifies: a round that accepts the whole
    draft and whose bonus is the card's guess is answered from the prefetched draft, which is
    the draft the card would have made anyway."""
    model, image, _ = model_pair
    target = f"tiny-{model.config.model_type}"
    engines = build_engines(["lookup"], [image], 4, 256)
    runtime = CardRuntime(4, 256, engines, background_prefetch=False)
    with served(runtime) as server, open_card(server.url) as card:
        streams = [card.open_stream(target=target) for _ in range(3)]
        prompts = [tokens(8, seed=30 + i) for i in range(3)]
        drafts = []
        for s, p in zip(streams, prompts, strict=True):
            s.prefill(p)
            drafts.append(s.draft(4))
        hits = 0
        for _ in range(5):
            for i, s in enumerate(streams):
                full = prompts[i] + list(drafts[i].tokens)
                bonus = generate(model, full, 1)[0]  # the target agrees with the draft
                d = s.commit(Verdict(4, bonus), 4)
                assert list(d.tokens) == generate(model, [*full, bonus], 4)
                hits += d.prefetch_hit
                prompts[i] = [*full, bonus]
                drafts[i] = d
        assert hits >= 12  # the guess is the model's own next token: nearly every round
        assert card.stats()["prefetch_hits"] == hits
