"""``exstill eval``: a draft measured as the field measures it, on the target's own greedy text.

For each prompt the target (an HF checkpoint directory or a GGUF file, run by transformers)
continues greedily; every draft given (a card image) and prompt lookup are then scored along
that continuation (acceptance.py, drafters.py). The report holds, per drafter and per prompt
category and over all prompts:

- ``tau``: mean tokens kept per verification pass at each K (1.0 is the target alone);
- ``acceptance_by_depth``: at the largest K, the share of passes reaching each depth whose
  drafted token there was kept;
- ``coverage_by_depth``: at the largest K, the share of passes reaching each depth whose target
  token was among the draft's k most likely, k = 1..8 (what a tree that wide could keep; model
  drafts only);
- ``top_k``: the same over every depth reached, for k = 1..8: what ``exstill plan`` reads as
  ``acceptance.top_k`` to weigh trees and prefetch for several outcomes (model drafts only);
- ``head_coverage``: for a draft with a frequency-ranked head, the share of the target's tokens
  inside the head (the draft can never propose the others);
- ``trees`` (with ``trees=`` budgets): for each budget N, tokens kept a pass by the chain of
  N - 1 tokens and by the card's trees of N - 1 nodes (trees.py), and the best tree over the
  chain.

And per draft, under ``calibration``: the rank temperature its image carries (by which the
card ranks tree nodes and outcomes) and the one these prompts fit (support/calibration.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.evaluation.acceptance import (
    COVERAGE_KS,
    Rounds,
    rounds,
    runs_from_chains,
    runs_from_matches,
)
from exstill_sdk.evaluation.drafters import LOOKUP, lookup_chains, target_ranks
from exstill_sdk.evaluation.prompts import Prompt
from exstill_sdk.evaluation.target import (
    continuation_logits,
    encode,
    greedy_continuation,
    load_model,
    load_tokenizer,
    torch_device,
)
from exstill_sdk.evaluation.trees import TREE_TOP_KS, CardTrees, check_budgets
from exstill_sdk.image.reader import open_image
from exstill_sdk.support.calibration import RankTemperatureFit

ALL = "all"


@dataclass
class _Tally:
    """Rounds summed over prompts, for each K."""

    prompts: int = 0
    by_k: dict[int, Rounds] = field(default_factory=dict)
    continuation: int = 0
    in_head: int | None = None
    """Continuation tokens inside the draft's frequency-ranked head (None: no head)."""
    tree_passes: dict[int, dict[str, int]] = field(default_factory=dict)
    """tree_passes[N][shape]: passes at budget N, shape "chain" or "top<k>"."""

    def add(
        self,
        by_k: dict[int, Rounds],
        tokens: int,
        in_head: int | None,
        tree_passes: dict[int, dict[str, int]],
    ) -> None:
        self.prompts += 1
        self.continuation += tokens
        if in_head is not None:
            self.in_head = (self.in_head or 0) + in_head
        for k, r in by_k.items():
            self.by_k[k] = self.by_k[k] + r if k in self.by_k else r
        for budget, shapes in tree_passes.items():
            mine = self.tree_passes.setdefault(budget, dict.fromkeys(shapes, 0))
            for shape, passes in shapes.items():
                mine[shape] += passes

    def report(self, model: bool) -> dict[str, Any]:
        d = self.by_k[max(self.by_k)]  # the counts by depth are the largest K's
        reached = np.maximum(d.reached, 1)
        out: dict[str, Any] = {
            "prompts": self.prompts,
            "tokens": d.tokens,
            "tau": {str(k): round(r.tau, 4) for k, r in sorted(self.by_k.items())},
            "acceptance_by_depth": [round(float(x), 4) for x in d.accepted / reached],
        }
        if model:
            out["coverage_by_depth"] = {
                str(w): [round(float(x), 4) for x in d.covered[i] / reached]
                for i, w in enumerate(COVERAGE_KS)
            }
            out["top_k"] = [round(c, 4) for c in d.top_k]
        if self.in_head is not None:
            out["head_coverage"] = round(self.in_head / max(self.continuation, 1), 4)
        if self.tree_passes:
            out["trees"] = {str(n): self._tree_row(s) for n, s in sorted(self.tree_passes.items())}
        return out

    def _tree_row(self, passes: dict[str, int]) -> dict[str, float]:
        row = {shape: round(self.continuation / max(p, 1), 4) for shape, p in passes.items()}
        best = max(v for shape, v in row.items() if shape != "chain")
        row["best_over_chain"] = round(best / row["chain"], 4)
        return row


def _drafts(
    paths: Sequence[str | Path], tokenizer: Any, device: str
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, float]]:
    """Each draft image as a transformers model on ``device``, once every image is known to
    be made in the target's tokenizer; the head ids of those with a frequency-ranked head;
    each image's rank temperature."""
    from exstill_sdk.image.hf import to_hf_model
    from exstill_sdk.image.tokenizer import fingerprint_hf_tokenizer

    want = fingerprint_hf_tokenizer(tokenizer)
    for path in paths:
        with open_image(path) as image:
            differs = want.mismatch(image.tokenizer)
        if differs:
            raise InvalidArgumentError(
                f"draft {path} was packed for another tokenizer ({differs}): a draft must be "
                "made in its target's tokenizer"
            )
    models, heads, temperatures = {}, {}, {}
    for path in paths:
        with open_image(path) as image:
            name = Path(path).stem
            models[name] = to_hf_model(image).to(device)
            temperatures[name] = image.rank_temperature
            if image.head_ids is not None:
                heads[name] = image.head_ids.copy()
    return models, heads, temperatures


def evaluate(
    target: str | Path,
    drafts: Sequence[str | Path],
    prompts: Sequence[Prompt],
    *,
    max_k: int = 8,
    new_tokens: int = 64,
    lookup: bool = True,
    trees: Sequence[int] = (),
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Score each draft (and prompt lookup) on the target's greedy continuation of each
    prompt; with ``trees`` (budgets N), each draft's trees of N - 1 nodes against its chain of
    N - 1 tokens too. Torch runs the target and the drafts' teacher-forced passes on
    ``device`` (``target.torch_device``); the card's trees run on the CPU, as on the card's
    emulator. The report module docstring describes."""
    if not 1 <= max_k <= 32:
        raise InvalidArgumentError(f"--max-k must be 1..32, not {max_k}")
    if not drafts and not lookup:
        raise InvalidArgumentError("nothing to measure: give a --draft, or keep prompt lookup")
    budgets = check_budgets(trees)
    if budgets and not drafts:
        raise InvalidArgumentError("--trees measures a draft's trees: give a --draft")
    tokenizer = load_tokenizer(target)
    device = torch_device(device)
    models, heads, temperatures = _drafts(drafts, tokenizer, device)
    fits = {name: RankTemperatureFit() for name in models}
    model = load_model(target, device)
    names = list(models) + ([LOOKUP] if lookup else [])
    tallies: dict[str, dict[str, _Tally]] = {name: {} for name in names}
    ks = range(1, max_k + 1)
    longest = max([max_k, *(n - 1 for n in budgets)])
    encoded = [encode(tokenizer, prompt) for prompt in prompts]
    with ExitStack() as opened:
        growers = {}
        if budgets:
            room = max(map(len, encoded), default=0) + new_tokens + longest * max(TREE_TOP_KS) + 1
            for name, path in zip(models, drafts, strict=True):
                growers[name] = CardTrees(opened.enter_context(open_image(path)), room)
        for done, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            continuation = greedy_continuation(model, ids, new_tokens)
            if continuation:
                y = np.array(continuation, dtype=np.int64)
                for name in names:
                    tree_passes: dict[int, dict[str, int]] = {}
                    if name == LOOKUP:
                        ranks = None
                        runs = runs_from_chains(lookup_chains(ids, continuation, max_k), y)
                    else:
                        logits = continuation_logits(models[name], ids, continuation)
                        scores = logits.numpy()
                        ranks = target_ranks(scores, continuation)
                        fits[name].add(scores, y)
                        runs = runs_from_matches(ranks == 0, longest)
                        for n in budgets:
                            tree_passes[n] = {"chain": rounds(runs, n - 1).passes} | {
                                f"top{k}": growers[name].passes(ids, continuation, n, k)
                                for k in TREE_TOP_KS
                            }
                    by_k = {k: rounds(runs, k, ranks if k == max_k else None) for k in ks}
                    head = heads.get(name)
                    in_head = None if head is None else int(np.isin(y, head).sum())
                    for group in (prompt.category, ALL):
                        tally = tallies[name].setdefault(group, _Tally())
                        tally.add(by_k, len(y), in_head, tree_passes)
            if progress:
                progress(done + 1, len(prompts))
    return {
        "target": str(target),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "max_k": max_k,
        "tree_budgets": list(budgets),
        "device": device,
        "drafters": {
            name: {
                group: tally.report(name != LOOKUP)
                for group, tally in sorted(by_group.items(), key=lambda kv: kv[0] == ALL)
            }
            for name, by_group in tallies.items()
        },
        "calibration": {
            name: {
                "rank_temperature": temperatures[name],
                "rank_temperature_fit": fit.best(),
                "positions": fit.rows,
            }
            for name, fit in fits.items()
        },
    }
