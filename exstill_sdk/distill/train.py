"""Training the draft to agree with the target on the target's own answers.

The loss at each answer position is the cross-entropy of the draft against the target's
distribution there, renormalised over the target's top-k tokens (data.py): KL(target || draft)
up to a constant, the divergence whose minimum makes the draft's guesses the target's. Logits
are computed only where an answer token is predicted (the output head is most of a small
draft's cost: 49,152 x 576 for SmolLM2), and a long prompt keeps only its last ``max_len``
tokens before the answer. AdamW, with the learning rate warmed up over the first 5% of the
time budget and decayed on a cosine over the rest (time, not steps, is what the user gives).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from exstill_sdk.distill.data import Example
from exstill_sdk.support.calibration import RankTemperatureFit

MAX_LEN = 768


def learning_rate(peak: float, progress: float) -> float:
    """Warm-up over the first 5% of the budget, then cosine decay to a tenth of ``peak``."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < 0.05:
        return peak * (0.1 + 0.9 * progress / 0.05)
    tail = (progress - 0.05) / 0.95
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))


def window(e: Example, max_len: int = MAX_LEN) -> tuple[np.ndarray, int]:
    """An example's ids cut to at most ``max_len`` (the prompt's start goes, the answer stays,
    one prompt token at least), and where its answer starts in them."""
    cut = max(0, e.start - max(1, max_len - (len(e.ids) - e.start)))
    return e.ids[cut:], e.start - cut


def batch_loss(draft: Any, batch: Sequence[Example], max_len: int = MAX_LEN) -> Any:
    """Mean soft cross-entropy over every answer position of the batch."""
    import torch

    rows = [(*window(e, max_len), e) for e in batch]
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    where_r, where_p, top_ids, top_logp = [], [], [], []
    for r, (row_ids, start, e) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.from_numpy(row_ids.astype(np.int64))
        mask[r, : len(row_ids)] = 1
        answer = len(row_ids) - start
        # the distribution for answer token i is predicted at position start + i - 1
        where_r.append(torch.full((answer,), r, dtype=torch.long))
        where_p.append(torch.arange(start - 1, start - 1 + answer))
        top_ids.append(torch.from_numpy(e.top_ids.astype(np.int64)))
        top_logp.append(torch.from_numpy(e.top_logp.astype(np.float32)))
    on = draft.device
    hidden = draft.model(input_ids=ids.to(on), attention_mask=mask.to(on)).last_hidden_state
    picked = hidden[torch.cat(where_r).to(on), torch.cat(where_p).to(on)]
    logq = torch.log_softmax(draft.lm_head(picked).float(), dim=-1)
    want = torch.softmax(torch.cat(top_logp).to(on), dim=-1)  # renormalised over the top k
    return -(want * logq.gather(1, torch.cat(top_ids).to(on))).sum(-1).mean()


def answer_logits(
    draft: Any, examples: Sequence[Example], max_len: int = MAX_LEN
) -> Iterator[tuple[Any, np.ndarray]]:
    """For each example, the draft's logits at its answer positions (a torch tensor
    [answer, vocab], on the draft's device) and the target's most likely token at each."""
    import torch

    with torch.no_grad():
        for e in examples:
            kept, start = window(e, max_len)
            ids = torch.from_numpy(kept.astype(np.int64))[None].to(draft.device)
            yield draft(input_ids=ids).logits[0, start - 1 : -1], e.top_ids[:, 0]


def agreement(draft: Any, examples: Sequence[Example], max_len: int = MAX_LEN) -> float:
    """Share of answer positions where the draft's most likely token is the target's."""
    hits = total = 0
    for logits, best in answer_logits(draft, examples, max_len):
        guess = logits.argmax(-1).cpu().numpy()
        hits += int((guess == best).sum())
        total += len(guess)
    return hits / total if total else 0.0


def rank_temperature(
    draft: Any, examples: Sequence[Example], head_ids: Sequence[int] | None
) -> float | None:
    """The temperature that calibrates the draft's probabilities of the target's tokens over
    ``examples`` (support/calibration.py), its softmax over the head's tokens alone when it has
    one, as the card's is."""
    import torch

    fit = RankTemperatureFit()
    if head_ids is None:
        for logits, best in answer_logits(draft, examples):
            fit.add(logits.float().cpu().numpy(), best)
        return fit.best()
    row_of = {int(t): row for row, t in enumerate(head_ids)}
    columns = torch.tensor(list(row_of), dtype=torch.long, device=draft.device)
    for logits, best in answer_logits(draft, examples):
        rows = np.array([row_of.get(int(t), -1) for t in best], np.int64)
        fit.add(logits[:, columns].float().cpu().numpy(), rows)
    return fit.best()
