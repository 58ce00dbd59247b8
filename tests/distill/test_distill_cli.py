"""exstill distill end to end on a tiny real target: the image it packs loads, is made in the
target's tokenizer, drafts on the emulated card, and never changes the target's output; a
stopped run continues; the distilled draft agrees with the target better than where it
started on the answers it trained on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exstill_sdk import open_card  # noqa: E402
from exstill_sdk.adapters.hf import HFTarget  # noqa: E402
from exstill_sdk.distill.data import load_examples  # noqa: E402
from exstill_sdk.distill.model import draft_from_target, kept_layers  # noqa: E402
from exstill_sdk.image import open_image  # noqa: E402
from exstill_sdk.image.tokenizer import fingerprint_tokenizer_json  # noqa: E402
from exstill_sdk.speculative import SpeculativeDecoder  # noqa: E402

from ..image.checkpoints import save_model  # noqa: E402


def _distill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exstill_sdk.cli.main", "distill", *args],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("distill") / "target", "llama", scale=0.5)


def test_distil_pack_and_draft_exactly(target: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "\n".join(" ".join(f"w{(i * 11 + j * 3) % 90}" for j in range(8)) for i in range(48))
    )
    work, image = tmp_path / "work", tmp_path / "draft.img"
    common = [str(target), "-o", str(image), "--prompts", str(prompts), "--examples", "48"]
    common += ["--answer-tokens", "24", "--work-dir", str(work), "--json", "--layers"]
    # a fixed number of steps, well within the time: the verdict does not rest on the clock
    first = _distill(*common, "1", "--minutes", "10", "--steps", "200", "--head", "48")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["examples"] == 48 and report["steps"] == 200
    assert report["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    # a frequency-ranked head of half the vocabulary, its ids kept for exstill-pack --head-ids
    head = json.loads((work / "head-ids.json").read_text())
    assert report["head_size"] == len(head) == 48 and {0, 1, 2} <= set(head)
    assert 0.0 < report["head_coverage"] <= 1.0
    with open_image(image) as img:
        assert img.head_ids.tolist() == head
        # the temperature fitted on the held-out answers is packed (tests/distill/test_train.py)
        assert img.rank_temperature == report["rank_temperature"]
        assert 0.1 <= report["rank_temperature"] <= 10.0
    # it learns the target's answers (a random tiny target has nothing more general to learn)
    assert report["train_agreement_after"] > report["train_agreement_before"] + 0.2
    assert 0.0 <= report["agreement_after"] <= 1.0
    shards = sorted((work / "data").glob("shard-*[0-9].npz"))
    assert len(shards) == 2  # 48 prompts, 32 a batch
    examples = load_examples(shards[0])
    assert all(e.top_ids.shape == (len(e.ids) - e.start, 16) for e in examples)
    # halfway through training the draft answered a quarter of the prompts, scored by the target
    own = load_examples(work / "data" / "on-policy.npz")
    assert len(own) == 12 and all(e.top_ids.shape[1] == 16 for e in own)
    stamp = [s.stat().st_mtime_ns for s in shards]

    # run again: the data is reused and training goes on from where it stopped
    again = _distill(*common, "1", "--minutes", "10", "--steps", "260")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["steps"] == 260
    # the draft's greedy output is checked below with the head packed again (another option)
    headed = _distill(*common, "1", "--minutes", "10", "--steps", "260", "--head", "48")
    assert headed.returncode == 0 and json.loads(headed.stdout)["head_size"] == 48
    assert [s.stat().st_mtime_ns for s in shards] == stamp
    other = _distill(*common, "2", "--minutes", "0.25")
    assert other.returncode == 2 and "other options (layers)" in json.loads(other.stdout)["error"]

    with open_image(image, verify=True) as img:
        assert img.arch.num_layers == 1 and img.quant == "f16"
        assert img.tokenizer.matches(fingerprint_tokenizer_json(target / "tokenizer.json"))
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager")
    rng = np.random.default_rng(5)
    batch = [rng.integers(3, 90, 6).tolist() for _ in range(6)]
    want = []
    for p in batch:
        ids = torch.tensor([p])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=32,
            eos_token_id=None,
            pad_token_id=0,
        )
        want.append(out[0, len(p) :].tolist())
    with open_card(f"emu://?image={image}&context=256") as card:
        decoder = SpeculativeDecoder(card, HFTarget(model), draft="target", k=4)
        got = decoder.generate_batch(batch, 32, stop_token_ids=[])
        assert [r.tokens for r in got] == want
        assert decoder.metrics.num_draft_tokens > 0


def test_device_mistakes_are_one_line(target: Path, tmp_path: Path) -> None:
    cases = [("tpu", "--device must be auto, cpu, cuda or cuda:N, not 'tpu'")]
    cases.append(("cuda:x", "--device must be auto, cpu, cuda or cuda:N"))
    if not torch.cuda.is_available():
        cases.append(("cuda", "--device cuda: torch sees no CUDA GPU here"))
    else:
        cases.append(("cuda:99", "torch sees"))
    for device, message in cases:
        out = _distill(str(target), "-o", str(tmp_path / "d.img"), "--device", device)
        assert out.returncode == 2, out.stderr
        assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "d.img").exists()


def test_the_draft_starts_as_the_target_cut_down(target: Path) -> None:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(target)
    assert kept_layers(30, 4) == [0, 10, 19, 29]
    full = draft_from_target(model, 2)  # both of the tiny target's layers: the target itself
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(full(ids).logits, model(ids).logits)
    one = draft_from_target(model, 1)
    assert torch.equal(
        one.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight
    )


@pytest.mark.parametrize("chat", [False, True])
def test_the_target_writes_its_own_prompts(target: Path, chat: bool) -> None:
    import transformers as tf

    from exstill_sdk.distill.data import self_written_prompts

    model = tf.AutoModelForCausalLM.from_pretrained(target)
    tokenizer = tf.AutoTokenizer.from_pretrained(target)
    if chat:  # a chat template: the prompt is what the model writes in the user's turn
        tokenizer.chat_template = (
            "{% for m in messages %}<s> w1 w2 {{ m['content'] }} </s>{% endfor %}"
            "{% if add_generation_prompt %}<s> w3{% endif %}"
        )
    seen = []
    prompts = self_written_prompts(
        model, tokenizer, 6, batch=4, seed=1, progress=lambda *a: seen.append(a)
    )
    assert len(prompts) == 6 and len(set(prompts)) == 6
    assert all(p.strip() == p and len(p) >= 8 for p in prompts)
    assert all(p.startswith("w") for p in prompts)  # the tiny vocabulary's words, no specials
    assert seen[-1] == ("writing prompts", 6, 6)
