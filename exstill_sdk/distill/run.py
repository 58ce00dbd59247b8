"""``exstill distill``: a draft for any target, made from the target's own outputs and packed.

A run lives in a work directory, so that Ctrl-C and running the same command again continues
where it stopped:

- ``run.json``: the options that shape the result (a run with other options is refused);
- ``prompts.json``: the prompts, the user's or the target's own (data.py);
- ``data/shard-NNNNN.npz``: the target's answers, one shard a batch of prompts;
- ``data/on-policy.npz``: the draft's own answers, scored by the target (halfway through);
- ``train.pt``: the draft, its optimiser and the time spent training, saved every minute;
- ``draft/``: the draft as an HF checkpoint with the target's tokenizer, packed at the end;
- ``head-ids.json``: the frequency-ranked head's token ids (head.py), packed with it.

The time budget (``minutes``) covers the whole run: gathering data stops at 40% of it (or when
every prompt is answered), and training uses what remains. A continued run keeps the training
budget the first one set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.distill.data import (
    examples_from,
    generate,
    load_examples,
    save_examples,
    self_written_prompts,
    target_logits,
)
from exstill_sdk.distill.head import coverage, default_size, frequency_ranked
from exstill_sdk.distill.model import draft_from_target
from exstill_sdk.distill.train import agreement, batch_loss, learning_rate, rank_temperature
from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.evaluation.prompts import Prompt, load_prompts
from exstill_sdk.evaluation.target import encode, load_model, load_tokenizer, torch_device

DATA_SHARE = 0.4
ON_POLICY_AT = 0.5
"""Share of the training budget after which the draft answers prompts itself for the target to
score (data.py)."""
ON_POLICY_SHARE = 0.25
"""Share of the prompts the draft answers then."""
SAVE_EVERY_S = 60.0
HELD_OUT = (8, 64)
"""Examples kept out of training to report the draft's agreement with the target: a twentieth
of them, within these bounds."""
TRAIN_SAMPLE = 64
"""Training examples the agreement on the training data is reported over."""


@dataclass(frozen=True)
class DistillOptions:
    target: str
    prompts: str | None = None
    examples: int = 1600
    layers: int = 4
    answer_tokens: int = 64
    batch: int = 8
    gen_batch: int = 32
    """Prompts the target writes or answers at once: on this 2-core CPU, 16 a batch gave 150
    tokens/s, 48 gave 260 (weights read once a step serve every row)."""
    top_k: int = 16
    lr: float = 5e-4
    seed: int = 0

    def shaping(self) -> dict[str, Any]:
        """What a resumed run must share with the one it continues."""
        return asdict(self)


@dataclass
class DistillResult:
    image: str
    work_dir: str
    examples: int
    steps: int
    train_seconds: float
    agreement_before: float
    agreement_after: float
    """Share of held-out answer positions where the draft's top token is the target's."""
    train_agreement_before: float
    train_agreement_after: float
    """The same over training answers: far above the held-out figure means too little data."""
    head_size: int
    """Tokens of the frequency-ranked head (0: the whole vocabulary; head.py)."""
    head_coverage: float | None
    """Share of held-out answer tokens inside the head."""
    rank_temperature: float | None
    """The temperature that calibrates the draft's probabilities on the held-out answers
    (support/calibration.py), packed in the image."""
    device: str
    """Where torch ran the target and the draft."""
    pack: dict[str, Any]


Report = Callable[[str, int, int], None]
"""progress(stage, done, total)."""


def _check_run(work: Path, options: DistillOptions) -> None:
    path = work / "run.json"
    now = options.shaping()
    if path.exists():
        before = json.loads(path.read_text())
        if before != now:
            changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            raise InvalidArgumentError(
                f"{work} holds a run with other options ({', '.join(changed)}); give another "
                "--work-dir, or --restart to start this one again"
            )
    else:
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(now, indent=1))


def _prompts(
    work: Path,
    options: DistillOptions,
    model: Any,
    tokenizer: Any,
    deadline: float,
    progress: Report | None,
) -> list[str]:
    path = work / "prompts.json"
    if path.exists():
        texts: list[str] = json.loads(path.read_text())
        return texts
    if options.prompts:
        texts = [p.text for p in load_prompts(options.prompts)]
    else:
        texts = self_written_prompts(
            model,
            tokenizer,
            options.examples,
            batch=options.gen_batch,
            seed=options.seed,
            deadline=deadline,
            progress=progress,
        )
    if not texts:
        raise InvalidArgumentError("no prompts to answer: give --prompts FILE")
    rng = np.random.default_rng(options.seed)
    order = rng.permutation(len(texts))
    texts = [texts[i] for i in order[: options.examples]]
    path.write_text(json.dumps(texts))
    return texts


def _batch_count(texts: list[str], size: int) -> int:
    return (len(texts) + size - 1) // size


def _encoded_batch(tokenizer: Any, texts: list[str], index: int, size: int) -> list[list[int]]:
    """The ids of the ``index``-th batch of ``size`` prompts."""
    return [encode(tokenizer, Prompt("distill", t)) for t in texts[index * size :][:size]]


def _gather(
    work: Path,
    options: DistillOptions,
    model: Any,
    tokenizer: Any,
    texts: list[str],
    deadline: float,
    progress: Report | None,
) -> list[Any]:
    data = work / "data"
    data.mkdir(exist_ok=True)
    shards = _batch_count(texts, options.gen_batch)
    for shard in range(shards):
        path = data / f"shard-{shard:05d}.npz"
        if path.exists():
            continue
        if time.monotonic() > deadline and shard:
            break
        batch = _encoded_batch(tokenizer, texts, shard, options.gen_batch)
        sample = shard % 2 == 1  # greedy and sampled answers, alternately
        answers, logits = generate(
            model,
            tokenizer,
            batch,
            options.answer_tokens,
            sample=sample,
            seed=options.seed + shard,
        )
        save_examples(path, examples_from(batch, answers, logits, options.top_k))
        if progress:
            progress("answering prompts", shard + 1, shards)
    examples = []
    for path in sorted(data.glob("shard-*[0-9].npz")):
        examples.extend(load_examples(path))
    return examples


def _on_policy(
    work: Path,
    options: DistillOptions,
    target: Any,
    draft: Any,
    tokenizer: Any,
    texts: list[str],
    progress: Report | None,
) -> list[Any]:
    """The draft answers a share of the prompts (greedy and sampled by turns), the target
    scores its answers; saved as data/on-policy.npz."""
    chosen = texts[: max(1, int(len(texts) * ON_POLICY_SHARE))]
    batches = _batch_count(chosen, options.gen_batch)
    draft.eval()
    examples = []
    for b in range(batches):
        batch = _encoded_batch(tokenizer, chosen, b, options.gen_batch)
        answers, _ = generate(
            draft,
            tokenizer,
            batch,
            options.answer_tokens,
            sample=b % 2 == 1,
            seed=options.seed + 100_000 + b,
        )
        logits = target_logits(target, batch, answers)
        examples += examples_from(batch, answers, logits, options.top_k)
        if progress:
            progress("on-policy answers", b + 1, batches)
    save_examples(work / "data" / "on-policy.npz", examples)
    return examples


def _save_state(path: Path, state: dict[str, Any]) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def distill(
    options: DistillOptions,
    output: str | Path,
    *,
    name: str,
    work_dir: str | Path,
    minutes: float = 60.0,
    max_steps: int | None = None,
    dtype: str = "f16",
    head: int | None = None,
    device: str = "auto",
    progress: Report | None = None,
) -> DistillResult:
    """Gather the target's answers, train the draft for the rest of the budget (or to
    ``max_steps`` steps in all, when that comes first), pack it with a frequency-ranked head
    of ``head`` tokens (None: head.py's default for the vocabulary; 0: the whole). Torch runs
    on ``device`` (``evaluation.target.torch_device``); a run may continue on another."""
    import torch

    if minutes <= 0:
        raise InvalidArgumentError("--minutes must be more than 0")
    device = torch_device(device)
    begin = time.monotonic()
    budget_s = minutes * 60.0
    work = Path(work_dir)
    _check_run(work, options)
    torch.manual_seed(options.seed)
    tokenizer = load_tokenizer(options.target)
    target = load_model(options.target, device)
    # the target writing prompts takes up to half of the data's share, answering the rest
    texts = _prompts(work, options, target, tokenizer, begin + DATA_SHARE * budget_s / 2, progress)
    examples = _gather(
        work, options, target, tokenizer, texts, begin + DATA_SHARE * budget_s, progress
    )
    held_out = min(HELD_OUT[1], max(HELD_OUT[0], len(examples) // 20))
    if len(examples) <= 2 * held_out:
        raise InvalidArgumentError(
            f"only {len(examples)} answers gathered: give more --examples or more --minutes"
        )
    held, train = examples[:held_out], examples[held_out:]

    draft = draft_from_target(target, options.layers)
    before = agreement(draft.eval(), held), agreement(draft, train[:TRAIN_SAMPLE])
    optimiser = torch.optim.AdamW(draft.parameters(), lr=options.lr, weight_decay=0.0)
    state_path = work / "train.pt"
    step, spent = 0, 0.0
    train_budget = max(budget_s - (time.monotonic() - begin), 1.0)
    if state_path.exists():  # a run that stopped: its own budget, not a new one
        state = torch.load(state_path, weights_only=False, map_location=device)
        draft.load_state_dict(state["draft"])
        optimiser.load_state_dict(state["optimiser"])
        step, spent, train_budget = state["step"], state["seconds"], state["budget"]
    on_policy_done = (work / "data" / "on-policy.npz").exists()
    if on_policy_done:
        train += load_examples(work / "data" / "on-policy.npz")
    rng = np.random.default_rng(options.seed + step)
    draft.train()
    last_save = time.monotonic()
    clock = time.monotonic()

    def done_share() -> float:  # how far training is, by time or by steps
        share = spent / train_budget
        return max(share, step / max_steps) if max_steps else share

    try:
        while done_share() < 1.0:
            if not on_policy_done and done_share() >= ON_POLICY_AT:
                train += _on_policy(work, options, target, draft, tokenizer, texts, progress)
                draft.train()
                on_policy_done = True
                clock = time.monotonic()  # the target's scoring counts as training time

            lr = learning_rate(options.lr, done_share())
            for group in optimiser.param_groups:
                group["lr"] = lr
            picks = rng.choice(len(train), size=min(options.batch, len(train)), replace=False)
            loss = batch_loss(draft, [train[i] for i in picks])
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimiser.step()
            step += 1
            now = time.monotonic()
            spent += now - clock
            clock = now
            if progress:
                progress("training", int(spent), int(train_budget))
            if now - last_save > SAVE_EVERY_S:
                _save_state(state_path, _state(draft, optimiser, step, spent, train_budget))
                last_save = now
    finally:  # Ctrl-C included: the next run continues from here
        _save_state(state_path, _state(draft, optimiser, step, spent, train_budget))
    draft.eval()
    after = agreement(draft, held), agreement(draft, train[:TRAIN_SAMPLE])
    head_ids = _head(work, target, tokenizer, train, head)
    temperature = rank_temperature(draft, held, head_ids)
    packed = _pack(draft, tokenizer, work, output, name, dtype, head_ids, temperature)
    return DistillResult(
        str(output),
        str(work),
        len(examples),
        step,
        round(spent, 1),
        round(before[0], 4),
        round(after[0], 4),
        round(before[1], 4),
        round(after[1], 4),
        len(head_ids or ()),
        None if head_ids is None else round(coverage(held, head_ids), 4),
        temperature,
        device,
        packed,
    )


def _head(
    work: Path, target: Any, tokenizer: Any, train: list[Any], size: int | None
) -> list[int] | None:
    """The frequency-ranked head's ids, from the training examples (the held-out ones stay
    out, so that its coverage of them is a fair figure); saved as head-ids.json, the file
    ``exstill-pack --head-ids`` reads. None for the whole vocabulary."""
    vocab = int(target.config.vocab_size)
    size = default_size(vocab) if size is None else size
    if size < 0:
        raise InvalidArgumentError("--head must be 0 (the whole vocabulary) or more")
    if not size or size >= vocab:
        return None
    eos = target.generation_config.eos_token_id
    always = [*tokenizer.all_special_ids, *(eos if isinstance(eos, list) else [eos] if eos else [])]
    ids = frequency_ranked(train, vocab, size, always)
    (work / "head-ids.json").write_text(json.dumps(ids))
    return ids


def _state(draft: Any, optimiser: Any, step: int, spent: float, budget: float) -> dict[str, Any]:
    return {
        "draft": draft.state_dict(),
        "optimiser": optimiser.state_dict(),
        "step": step,
        "seconds": spent,
        "budget": budget,
    }


def _pack(
    draft: Any,
    tokenizer: Any,
    work: Path,
    output: str | Path,
    name: str,
    dtype: str,
    head_ids: list[int] | None,
    rank_temperature: float | None,
) -> dict[str, Any]:
    from exstill_sdk.image.pack import pack_checkpoint

    where = work / "draft"
    draft.save_pretrained(where, safe_serialization=True)
    tokenizer.save_pretrained(where)
    return pack_checkpoint(
        where, output, name, dtype, head_ids=head_ids, rank_temperature=rank_temperature
    ).to_dict()
