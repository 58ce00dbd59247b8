"""A transformers causal LM as the target, with one KV cache per sequence (cropped on
rollback), so a decoder serves several sequences with one HF model: HF's own assisted
generation is limited to batch 1. A token tree is scored in one forward with a 4-D attention
mask (each node sees the context and its ancestors) and position ids by depth.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from exstill_sdk.image.tokenizer import fingerprint_hf_tokenizer
from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.speculative.trees import TokenTree, ancestry, depths
from exstill_sdk.support.tokens import CachedTokens


def _crop(cache: Any, length: int) -> None:
    """Keep ``length`` tokens of a DynamicCache (a negative crop removes tokens from the end
    in every transformers release that has crop; newer ones refuse positive values)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def cache_keyword(model: Any) -> str:
    """The name of ``model.forward``'s KV cache argument: transformers 5.x calls it ``cache``
    (``past_key_values`` is deprecated there and warns on every call); 4.45 up to those
    releases know only ``past_key_values``."""
    forward = inspect.signature(model.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


class HFTarget(TargetAdapter):
    def __init__(self, model: Any, tokenizer: Any = None) -> None:
        import torch  # noqa: F401 - the hf extra

        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self.supports_trees = True
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos_token_ids = tuple(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )
        self.tokenizer = fingerprint_hf_tokenizer(tokenizer) if tokenizer is not None else None
        self._caches: dict[int, tuple[Any, CachedTokens]] = {}
        self._cache_argument = cache_keyword(model)

    def _advance(
        self, seq_id: int, context: Sequence[int], draft: Sequence[int]
    ) -> tuple[Any, int, list[int]]:
        """The sequence's cache, cropped to what it shares with ``context``: (the cache, the
        position to feed from, the tokens to feed)."""
        from transformers import DynamicCache

        entry = self._caches.get(seq_id)
        if entry is None:
            entry = self._caches[seq_id] = (DynamicCache(), CachedTokens())
        cache, cached = entry
        start, tail = cached.advance(context, draft)  # O(new tokens)
        _crop(cache, start)
        return cache, start, tail

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        import torch

        cache, _, tail = self._advance(seq_id, context, draft)
        ids = torch.tensor([tail], device=self.model.device)
        with torch.no_grad():  # the model extends the cache in place
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_argument: cache})
        return out.logits[0, -(len(draft) + 1) :].float().cpu().numpy()

    def verify_tree(self, seq_id: int, context: Sequence[int], tree: TokenTree) -> np.ndarray:
        import torch

        cache, start, prefix = self._advance(seq_id, context, ())
        p, n = len(prefix), len(tree)
        allow = torch.zeros((p + n, start + p + n), dtype=torch.bool)
        allow[:, :start] = True
        allow[:p, start : start + p] = torch.tril(torch.ones((p, p), dtype=torch.bool))
        allow[p:, start : start + p] = True
        allow[p:, start + p :] = torch.from_numpy(ancestry(tree.parents))
        positions = [*range(start, start + p), *(start + p - 1 + d for d in depths(tree.parents))]
        device, dtype = self.model.device, self.model.dtype
        # An additive mask (0 or the dtype's lowest): every attention implementation adds a
        # float mask; eager attention would add a boolean one as 1 and 0, masking nothing.
        bias = torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([[*prefix, *tree.tokens]], device=device),
                attention_mask=bias[None, None].to(device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=True,
                **{self._cache_argument: cache},
            )
        return out.logits[0, p - 1 :].float().cpu().numpy()

    def keep_path(self, seq_id: int, tree: TokenTree, nodes: Sequence[int]) -> None:
        import torch

        cache, cached = self._caches[seq_id]
        context = len(cached.tokens)
        keep = torch.tensor([*range(context), *(context + i for i in nodes)])
        for layer in cache.layers:  # every node's keys and values follow the context
            layer.keys = layer.keys.index_select(-2, keep.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, keep.to(layer.values.device))
        cached.tokens += [tree.tokens[i] for i in nodes]

    def rollback(self, seq_id: int, length: int) -> None:
        entry = self._caches.get(seq_id)
        if entry is not None:
            cache, cached = entry
            _crop(cache, length)
            cached.rollback(length)

    def release(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
