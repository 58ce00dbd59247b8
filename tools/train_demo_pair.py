"""Train the demo pair: a small target LLM and a draft distilled from it, both packed as card
images under exstill_sdk/data/demo/.

The corpus is the Python standard library's own source (every machine has it): the ``*.py``
files under the running interpreter's stdlib, minus tests and site-packages, in sorted order.
Files whose path hashes to 0 mod 16 are held out for the benchmark's prompts.

1. A byte-level BPE tokenizer (``tokenizers``, 4,096 tokens, ``<|endoftext|>`` between files).
2. The target: a Llama (transformers' ``LlamaForCausalLM``, the card's reference architecture),
   hidden 256, 4 layers, 4 heads of 64, 2 KV heads, MLP 768, tied embeddings: 4.2M parameters.
   Next-token cross-entropy, AdamW, cosine schedule, 256-token windows.
3. The draft: hidden 128, 2 layers, 2 heads of 64, 1 KV head, MLP 384, tied: 0.9M parameters
   (0.22 of the target), distilled on the target's own next-token distributions
   (KL(target || draft) over the same windows), which is what speculative acceptance rewards.
4. Both saved as HF checkpoints (safetensors + tokenizer.json) and packed with exstill-pack's
   code as f16 images: ``target.img`` and ``draft.img``.

Seeds are fixed (torch, numpy and the data order); training runs for a fixed number of steps.
The committed pair was made on the project's 2-core development VM (CPython 3.11.7, torch
2.13.0 CPU) with::

    python tools/train_demo_pair.py --out exstill_sdk/data/demo --work /tmp/demo-train

which took about 25 minutes (the script prints its own timings and final losses).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np

VOCAB = 4096
WINDOW = 256
EOT = "<|endoftext|>"


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the running interpreter's stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test/", "site-packages/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        bucket = held_out if hashlib.sha256(rel.encode()).digest()[0] % 16 == 0 else train
        bucket.append(path)
    return train, held_out


def read_text(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


def encode(tokenizer_path: Path, texts: list[str]) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=mlp,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def batches(ids: np.ndarray, batch: int, steps: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - WINDOW - 1, batch)
        yield torch.from_numpy(np.stack([ids[s : s + WINDOW + 1] for s in starts]))


def schedule(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def optimise(  # type: ignore[no-untyped-def]
    model,
    loss_of,
    ids: np.ndarray,
    steps: int,
    batch: int,
    lr: float,
    *,
    weight_decay: float,
    seed: int,
    label: str,
) -> float:
    """AdamW with warm-up and cosine decay on ``loss_of(batch)``; the smoothed final loss."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    model.train()
    loss_avg = 0.0
    t0 = time.time()
    for step, xb in enumerate(batches(ids, batch, steps, seed=seed)):
        for g in opt.param_groups:
            g["lr"] = schedule(step, steps, lr)
        loss = loss_of(xb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = 0.98 * loss_avg + 0.02 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == steps - 1:
            print(f"{label} step {step}/{steps} {loss_avg:.3f} ({time.time() - t0:.0f} s)")
    return loss_avg


def train_target(model, ids: np.ndarray, steps: int, batch: int, lr: float) -> float:  # type: ignore[no-untyped-def]
    """Next-token cross-entropy."""
    import torch.nn.functional as F

    def loss_of(xb):  # type: ignore[no-untyped-def]
        logits = model(input_ids=xb[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1))

    return optimise(
        model, loss_of, ids, steps, batch, lr, weight_decay=0.1, seed=1, label="target loss:"
    )


def distil_draft(draft, target, ids: np.ndarray, steps: int, batch: int, lr: float) -> float:  # type: ignore[no-untyped-def]
    """KL(target || draft) over every position of the same windows."""
    import torch
    import torch.nn.functional as F

    target.eval()

    def loss_of(xb):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=xb[:, :-1]).logits.float(), -1)
        student = F.log_softmax(draft(input_ids=xb[:, :-1]).logits.float(), -1)
        return F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()

    return optimise(
        draft, loss_of, ids, steps, batch, lr, weight_decay=0.0, seed=2, label="draft KL:"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="exstill_sdk/data/demo", help="where the images go")
    p.add_argument("--work", default="/tmp/exstill-demo-train", help="checkpoints and scratch")
    p.add_argument("--target-steps", type=int, default=1500)
    p.add_argument("--draft-steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)

    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from exstill_sdk.image.pack import pack_checkpoint

    torch.manual_seed(0)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_paths, held_paths = corpus_files()
    texts = read_text(train_paths)
    tok_path = train_tokenizer(texts, work)
    ids = encode(tok_path, texts)
    print(f"corpus: {len(texts)} files, {len(ids):,} tokens ({time.time() - t0:.0f} s)")

    target = LlamaForCausalLM(llama_config(256, 4, 4, 2, 768))
    draft = LlamaForCausalLM(llama_config(128, 2, 2, 1, 384))
    n_t = sum(x.numel() for x in target.parameters())
    n_d = sum(x.numel() for x in draft.parameters())
    print(f"target {n_t:,} parameters, draft {n_d:,} ({n_d / n_t:.2f} of the target)")
    t1 = time.time()
    target_loss = train_target(target, ids, args.target_steps, args.batch, 3e-3)
    t2 = time.time()
    draft_kl = distil_draft(draft, target, ids, args.draft_steps, args.batch, 3e-3)
    t3 = time.time()

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token=EOT, pad_token=EOT)
    for name, model in (("target", target), ("draft", draft)):
        ck = work / name
        model.save_pretrained(ck)
        hf_tok.save_pretrained(ck)
        pack_checkpoint(ck, out / f"{name}.img", f"demo-{name}", "f16", image_version="1")
    (out / "tokenizer.json").write_bytes(tok_path.read_bytes())
    held = [p.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for p in held_paths]
    record = {
        "corpus_files": len(texts),
        "corpus_tokens": len(ids),
        "held_out_files": held,
        "target_parameters": n_t,
        "draft_parameters": n_d,
        "target_loss": round(target_loss, 4),
        "draft_kl": round(draft_kl, 4),
        "target_steps": args.target_steps,
        "draft_steps": args.draft_steps,
        "batch": args.batch,
        "window": WINDOW,
        "train_s": {"target": round(t2 - t1), "draft": round(t3 - t2), "total": round(t3 - t0)},
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "held_out_files"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
