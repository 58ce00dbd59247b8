"""Speculative decoding of a HF transformers model with a draft card (the built-in emulator by
default), checked token for token against model.generate.

    python examples/hf_generate.py                      # a tiny random Llama, built here
    python examples/hf_generate.py --model DIR --draft-image DRAFT.img --prompt "..."

Without --model, the script builds a tiny Llama from a config with random weights and a small
word-level tokenizer (nothing is downloaded), and packs the model's own weights as the draft
image (a draft that always agrees). With --model, DIR is a local HF checkpoint and DRAFT.img a
card image packed for the same tokenizer (exstill-pack DRAFT_DIR -o DRAFT.img --target NAME).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

try:
    import torch
    import transformers as tf
except ModuleNotFoundError as missing:
    print(
        f"examples/hf_generate.py needs {missing.name}: pip install torch==2.13.0 "
        "'exstill-sdk[hf]' (torch first, so that pip does not pull a CUDA build)",
        file=sys.stderr,
    )
    sys.exit(2)

from exstill_sdk import open_card
from exstill_sdk.adapters.hf import HFTarget
from exstill_sdk.image import open_image
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.speculative import SamplingParams, SpeculativeDecoder


def tiny_model(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    text = "the card drafts tokens and the target verifies every token it emits"
    words = text.split(" ")
    vocab = {
        "<s>": 0,
        "</s>": 1,
        "<unk>": 2,
        **{w: i + 3 for i, w in enumerate(dict.fromkeys(words))},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    tf.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local HF checkpoint directory (default: a tiny one)")
    parser.add_argument("--draft-image", help="card image of the draft (default: the model's own)")
    parser.add_argument("--url", default=None, help="card URL (default: the emulator)")
    parser.add_argument("--prompt", default="the card drafts tokens and the target verifies")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="exstill-hf-"))
    model_dir = Path(args.model) if args.model else tiny_model(work / "model")
    draft = Path(args.draft_image) if args.draft_image else work / "draft.img"
    if not args.draft_image:
        pack_checkpoint(model_dir, draft, "draft")
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tokenizer(args.prompt)["input_ids"]

    with open_image(draft) as image:
        name = image.target  # the card serves this image under its target name
    url = args.url or f"emu://?image={draft}&context=1024"
    with open_card(url) as card:
        if name not in {t.name for t in card.info().targets}:
            print(
                f"{url} has no target {name!r} (the draft image's); flash it with: "
                f"exstill-flash {draft} --url {url}",
                file=sys.stderr,
            )
            sys.exit(1)
        decoder = SpeculativeDecoder(
            card,
            HFTarget(model, tokenizer),
            draft=name,
            sampling=SamplingParams(temperature=args.temperature, seed=0),
        )
        result = decoder.generate(prompt, args.new_tokens)
    print(tokenizer.decode(prompt + result.tokens))
    m = result.metrics
    print(
        f"{len(result.tokens)} tokens, mean acceptance length {m.mean_acceptance_length:.2f}, "
        f"prefetch hits {m.prefetch_hits}, K chosen {dict(m.k_chosen)}"
    )
    if args.temperature == 0:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            plain = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.new_tokens,
            )
        plain_tokens = plain[0, len(prompt) :].tolist()
        assert result.tokens == plain_tokens[: len(result.tokens)], "differs from generate()"
        print("identical to model.generate(do_sample=False)")


if __name__ == "__main__":
    main()
