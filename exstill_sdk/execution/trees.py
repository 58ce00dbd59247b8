"""Scoring a token tree in one onnxruntime run, in an ``OnnxDecoder``'s own KV buffers.

``TreeRunner`` runs an image's tree graph (exstill_sdk.execution.graph, ``tree=True``) on one
row: the context tokens not cached yet (a chain; the last one is the tree's root) and then the
tree's nodes, each at the rotary position of its depth and seeing the context and its own
ancestors only (an attention bias). Every node's key and value land in the row's next cache
slots, in node order; ``keep_path`` then moves one path's entries to the slots right after the
context, where a chain of those tokens would have put them (their rotary positions are those
already), so that the row's cache holds context + path and decoding goes on from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.graph import build_decoder
from exstill_sdk.execution.runner import OnnxDecoder, open_session
from exstill_sdk.image.reader import CardImage
from exstill_sdk.support.trees import ancestry, depths


class TreeRunner:
    def __init__(self, image: CardImage, decoder: OnnxDecoder, threads: int = 0) -> None:
        self.decoder = decoder
        self.session = open_session(
            image, build_decoder(image, decoder.positions, tree=True), threads
        )

    def run(
        self, row: int, start: int, prefix: Sequence[int], tokens: Sequence[int],
        parents: Sequence[int],
    ) -> np.ndarray:  # fmt: skip
        """Feed ``prefix`` (the context from cache position ``start`` on, at least its last
        token) and the tree (``tokens``, ``parents``) to ``row``; logits [1 + N, vocab]: after
        the context, then after each node's path."""
        d = self.decoder
        if not prefix:
            raise InvalidArgumentError("a tree is scored after at least one context token")
        if start + len(prefix) + len(tokens) > d.positions:
            raise InvalidArgumentError(
                f"{start + len(prefix)} context tokens and a tree of {len(tokens)} exceed the "
                f"{d.positions} positions"
            )
        if not tokens:  # no tree: the context's last position alone
            return d.prefill(row, np.asarray(prefix, np.int64), start)
        if start == 0:
            # With nothing cached, onnxruntime's attention takes the run for a prompt and
            # applies neither position ids nor the bias: the context goes first on its own.
            first = d.prefill(row, np.asarray(prefix, np.int64), 0)
            rest = self._run(row, len(prefix), [], tokens, depths(parents), ancestry(parents))
            return np.concatenate([first, rest])
        return self._run(row, start, prefix, tokens, depths(parents), ancestry(parents))

    def grow(
        self, row: int, context: int, tokens: Sequence[int], parents: Sequence[int], first: int
    ) -> np.ndarray:
        """Add nodes ``first``.. of a tree whose nodes before ``first`` were fed already (by
        ``run`` or ``grow``, after the same ``context`` cached tokens); logits after each new
        node. A drafting engine grows its tree a batch of nodes at a time this way."""
        if context <= 0 or not 0 <= first < len(tokens):
            raise InvalidArgumentError("a tree grows after cached context, by at least one node")
        return self.add_nodes(
            row, context, tokens[first:], depths(parents)[first:], ancestry(parents)[first:]
        )

    def add_nodes(
        self,
        row: int,
        context: int,
        tokens: Sequence[int],
        node_depths: Sequence[int],
        visible: np.ndarray,
    ) -> np.ndarray:
        """``grow`` for a caller that keeps the tree's layout itself: the new nodes' tokens,
        depths (1: a child of the context) and ``visible`` [new, nodes] (True where a node
        sees a node: itself and its ancestors, every node fed so far and the new ones last)."""
        total = context + visible.shape[1]
        if total > self.decoder.positions:
            raise InvalidArgumentError(
                f"a tree of {visible.shape[1]} after {context} tokens exceeds the "
                f"{self.decoder.positions} positions"
            )
        return self._run(row, context, [], tokens, node_depths, visible)

    def _run(
        self, row: int, start: int, prefix: Sequence[int], tokens: Sequence[int],
        node_depths: Sequence[int], visible: np.ndarray,
    ) -> np.ndarray:  # fmt: skip
        """One run of the tree graph with at least one cached token (``start`` > 0); logits
        after the prefix's last token (when there is a prefix) and after each of the new nodes
        ``tokens`` (whose depths and visibility over every node are given; the nodes before
        them are cached already, after the context)."""
        d = self.decoder
        p, new = len(prefix), len(tokens)
        positions, bias = tree_attention(start, p, node_depths, visible)
        ids = np.asarray([*prefix, *tokens], np.int64)[None, :]
        total = bias.shape[-1]
        io = d.kv_binding(row, row + 1, "tree", self.session)
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        io.bind_cpu_input("logit_rows", np.arange(max(p - 1, 0), p + new, dtype=np.int64))
        io.bind_cpu_input("position_ids", positions[None, :])
        io.bind_cpu_input("attention_bias", bias[None, None])
        logits = np.empty((new + min(p, 1), d.vocab_size), np.float32)
        io.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return logits


def tree_attention(
    start: int, prefix: int, node_depths: Sequence[int] | np.ndarray, visible: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rotary positions [prefix + new] and attention bias [prefix + new, total] of a run that
    feeds ``prefix`` context tokens from cache position ``start`` (causal among themselves),
    then new tree nodes at their ``node_depths`` (1: a child of the context's last token),
    each seeing all the context and the nodes ``visible`` says ([new, nodes]: the tree's
    nodes fed so far, in slot order, the new ones last). With no nodes, a chain's inputs."""
    context = start + prefix
    new = len(node_depths)
    total = context + visible.shape[1]
    node_positions = context - 1 + np.asarray(node_depths, np.int64)
    positions = np.concatenate([np.arange(start, context, dtype=np.int64), node_positions])
    bias = np.full((prefix + new, total), -np.inf, np.float32)
    bias[:, :start] = 0
    bias[:prefix, start:context] = np.where(np.tril(np.ones((prefix, prefix), bool)), 0, -np.inf)
    bias[prefix:, start:context] = 0
    bias[prefix:, context:] = np.where(visible, 0, -np.inf)
    return positions, bias


def keep_path(decoder: OnnxDecoder, row: int, context: int, nodes: Sequence[int]) -> None:
    """After a tree was scored or grown in ``row`` with ``context`` tokens before it: move the
    keys and values of ``nodes`` (a path, root side first) to the slots right after the
    context."""
    first = 0  # nodes already in place (a chain's first nodes) stay
    while first < len(nodes) and nodes[first] == first:
        first += 1
    if first == len(nodes):
        return
    moved = nodes[first:]
    step = moved[1] - moved[0] if len(moved) > 1 else 1
    if step > 0 and all(b - a == step for a, b in pairwise(moved)):
        # evenly spaced (a node a level, as outcome drafts grow): one strided copy
        source: slice | np.ndarray = slice(context + moved[0], context + moved[-1] + 1, step)
    else:
        source = context + np.asarray(moved)
    target = slice(context + first, context + len(nodes))
    for buffer in (*decoder.keys, *decoder.values):
        cache = buffer[row]  # [kv_heads, positions, head_dim]: one shape for both sources
        cache[:, target] = cache[:, source]
