"""Training data from the target itself: its prompts (or the user's), its answers, and its
distribution at every answer position.

- **Prompts the target writes** (when the user gives none): an instruction model given only its
  chat template's opening of a user turn writes a plausible user message (Magpie). A model
  without a chat template writes text from its start token, and the opening of that text is
  the prompt.
- **Answers**: the target continues each prompt in batches (left-padded), greedily for half of
  them and sampled at temperature 1 for the other half, which is what the card will be asked to
  draft for; transformers' ``output_logits`` gives the target's raw logits at every step, so no
  second pass is needed.
- **What is kept**: per answer position the target's ``top_k`` most likely tokens and their
  log-probabilities (float16), the draft's training signal (train.py).
- **On-policy answers**: halfway through training the draft answers some of the prompts
  itself and the target scores those answers (``target_logits``), so that the draft also learns
  where its own text leads it, which is where it drafts (DistillSpec).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.evaluation.target import continuation_logits

SENTINEL = "\x00exstill-prompt\x00"


@dataclass(frozen=True)
class Example:
    ids: np.ndarray
    """int32 [prompt + answer]."""
    start: int
    """Index of the first answer token in ``ids``."""
    top_ids: np.ndarray
    """int32 [answer, k]: the target's k most likely tokens at each answer position."""
    top_logp: np.ndarray
    """float16 [answer, k]: their log-probabilities under the target."""


def save_examples(path: Path, examples: Sequence[Example]) -> None:
    """One shard of examples as an .npz (concatenated, with offsets), there whole or not at
    all: written beside ``path``, then renamed over it."""
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        ids=np.concatenate([e.ids for e in examples]),
        lengths=np.array([len(e.ids) for e in examples], dtype=np.int64),
        starts=np.array([e.start for e in examples], dtype=np.int64),
        top_ids=np.concatenate([e.top_ids for e in examples]),
        top_logp=np.concatenate([e.top_logp for e in examples]),
    )
    tmp.replace(path)


def load_examples(path: Any) -> list[Example]:
    with np.load(path) as f:
        ids, lengths, starts = f["ids"], f["lengths"], f["starts"]
        top_ids, top_logp = f["top_ids"], f["top_logp"]
    out, at, answer_at = [], 0, 0
    for length, start in zip(lengths.tolist(), starts.tolist(), strict=True):
        answer = length - start
        out.append(
            Example(
                ids[at : at + length],
                start,
                top_ids[answer_at : answer_at + answer],
                top_logp[answer_at : answer_at + answer],
            )
        )
        at += length
        answer_at += answer
    return out


def _stop_ids(tokenizer: Any, model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    sample: bool,
    seed: int,
    logits: bool = True,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """The target's continuations of a batch of prompts (each up to its first stop token,
    included), and, with ``logits``, its raw logits at each step of each (float32
    [steps, vocab]; a batch of 32 answers of 64 tokens holds 400 MB of them for a
    49,152-token vocabulary, so prompts are written without)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: every row's next token is at the end
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_p=None,
            top_k=None,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            output_logits=logits,
            return_dict_in_generate=True,
        )
    # [batch, steps, vocab]
    steps = torch.stack(out.logits, dim=1).float().cpu() if logits else None
    sequences = out.sequences[:, width:].cpu().tolist()
    stops = _stop_ids(tokenizer, model)
    answers, kept = [], []
    for row in range(len(prompts)):
        answer = [int(t) for t in sequences[row]]
        for i, t in enumerate(answer):
            if t in stops:
                answer = answer[: i + 1]
                break
        answers.append(answer)
        if steps is not None:
            kept.append(steps[row, : len(answer)].numpy())
    return answers, kept


def target_logits(
    model: Any, prompts: Sequence[list[int]], answers: Sequence[list[int]]
) -> list[np.ndarray]:
    """The target's raw logits at each answer position of answers someone else wrote (the
    draft's own, for on-policy training): one forward pass over prompt and answer each."""
    return [
        continuation_logits(model, prompt, answer).numpy()
        if answer
        else np.zeros((0, 0), dtype=np.float32)
        for prompt, answer in zip(prompts, answers, strict=True)
    ]


def examples_from(
    prompts: Sequence[list[int]], answers: Sequence[list[int]], logits: Sequence[Any], top_k: int
) -> list[Example]:
    """Examples of the answers that have tokens, with the target's top-k at each position."""
    import torch

    out = []
    for prompt, answer, step_logits in zip(prompts, answers, logits, strict=True):
        if not answer:
            continue
        logp = torch.log_softmax(torch.as_tensor(step_logits), dim=-1)
        top = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
        out.append(
            Example(
                np.array(prompt + answer, dtype=np.int32),
                len(prompt),
                top.indices.numpy().astype(np.int32),
                top.values.numpy().astype(np.float16),
            )
        )
    return out


def self_written_prompts(
    model: Any,
    tokenizer: Any,
    count: int,
    *,
    batch: int,
    seed: int,
    deadline: float = float("inf"),
    max_tokens: int = 64,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[str]:
    """Up to ``count`` user prompts the target writes itself (module docstring), distinct and
    non-empty; fewer when ``deadline`` (time.monotonic) passes."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=False
        )
        opening = rendered[: rendered.index(SENTINEL)]
        start = tokenizer(opening, add_special_tokens=False)["input_ids"]
    else:
        bos = tokenizer.bos_token_id
        start = [bos] if bos is not None else tokenizer(" ")["input_ids"][:1]
    found: dict[str, None] = {}
    attempt = 0
    while len(found) < count and attempt < 4 * count // batch + 4:
        if attempt and time.monotonic() > deadline:
            break
        answers, _ = generate(
            model,
            tokenizer,
            [start] * batch,
            max_tokens,
            sample=True,
            seed=seed + attempt,
            logits=False,
        )
        attempt += 1
        for answer in answers:
            text = tokenizer.decode(answer if template else answer[:32], skip_special_tokens=True)
            text = text.strip()
            if len(text) >= 8:
                found.setdefault(text)
        if progress:
            progress("writing prompts", min(len(found), count), count)
    return list(found)[:count]
