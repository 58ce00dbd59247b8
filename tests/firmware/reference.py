"""A small numpy implementation of the reference architecture and of the engine's long-context
policy (attention sinks + sliding window), written independently of the ONNX graph: keys are
kept un-rotated and rotated at use by their current cache position, so eviction just drops
entries. Used to check the engine's StreamingLLM path."""

from __future__ import annotations

import numpy as np

from exstill_sdk.image.reader import CardImage


def rope_tables(theta: float, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] of plain RoPE (no scaling), in float64, from the
    paper's definition: angle(p, i) = p / theta ** (2i / head_dim)."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    angles = np.arange(positions, dtype=np.float64)[:, None] / theta ** (2 * i / head_dim)
    return np.cos(angles), np.sin(angles)


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


class ReferenceStream:
    def __init__(self, image: CardImage, positions: int, sinks: int) -> None:
        self.a = a = image.arch
        self.w = {n: np.asarray(image.tensor(n), np.float64) for n in image.tensors}
        self.positions, self.sinks = positions, sinks
        assert a.rope_scaling.type in ("", "default"), "the reference knows plain RoPE only"
        self.cos, self.sin = rope_tables(a.rope_theta, a.head_dim, positions)
        shape = (a.num_layers, positions, a.num_kv_heads, a.head_dim)
        self.k = np.zeros(shape)
        self.v = np.zeros(shape)
        self.tokens: list[int] = []
        self.cached: list[int] = []
        self.evicted = 0

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # x [S, heads, hd]
        half = x.shape[-1] // 2
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def feed(self, ids: list[int], start: int) -> np.ndarray:
        """Run ids at cache positions start..; logits of the last one."""
        a, w, eps = self.a, self.w, self.a.rms_norm_eps
        n, hd = len(ids), a.head_dim
        x = w["embed.weight"][ids]
        pos = np.arange(start, start + n)
        for i in range(a.num_layers):
            p = f"layers.{i}."
            h = rms(x, w[p + "attn_norm.weight"], eps)
            q = h @ w[p + "attn.q.weight"].T
            k = h @ w[p + "attn.k.weight"].T
            v = h @ w[p + "attn.v.weight"].T
            if a.qkv_bias:
                q, k, v = (
                    q + w[p + "attn.q.bias"],
                    k + w[p + "attn.k.bias"],
                    v + w[p + "attn.v.bias"],
                )
            q = q.reshape(n, a.num_heads, hd)
            k = k.reshape(n, a.num_kv_heads, hd)
            if a.qk_norm:
                q = rms(q, w[p + "attn.q_norm.weight"], eps)
                k = rms(k, w[p + "attn.k_norm.weight"], eps)
            self.k[i, start : start + n] = k
            self.v[i, start : start + n] = v.reshape(n, a.num_kv_heads, hd)
            keys = self.rope(self.k[i, : start + n], np.arange(start + n))
            vals = self.v[i, : start + n]
            qr = self.rope(q, pos)
            group = a.num_heads // a.num_kv_heads
            out = np.empty((n, a.num_heads, hd))
            for hh in range(a.num_heads):
                scores = qr[:, hh] @ keys[:, hh // group].T / np.sqrt(hd)
                scores[np.arange(start + n)[None, :] > pos[:, None]] = -np.inf
                prob = np.exp(scores - scores.max(-1, keepdims=True))
                prob /= prob.sum(-1, keepdims=True)
                out[:, hh] = prob @ vals[:, hh // group]
            o = out.reshape(n, -1) @ w[p + "attn.o.weight"].T
            x = x + o
            h2 = rms(x, w[p + "mlp_norm.weight"], eps)
            g = h2 @ w[p + "mlp.gate.weight"].T
            x = (
                x
                + ((g / (1 + np.exp(-g))) * (h2 @ w[p + "mlp.up.weight"].T))
                @ w[p + "mlp.down.weight"].T
            )
        head = w["embed.weight"] if a.tie_embeddings else w["lm_head.weight"]
        return rms(x[-1], w["norm.weight"], eps) @ head.T

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def make_room(self, k: int) -> None:
        """The engine's policy: keep the sinks and (positions - sinks) // 2 - k recent tokens."""
        window = len(self.tokens)
        if window + k <= self.positions:
            return
        keep = max(0, (self.positions - self.sinks) // 2 - k)
        evict = window - self.sinks - keep
        committed_cached = 0
        while (
            committed_cached < min(len(self.cached), window)
            and self.cached[committed_cached] == self.tokens[committed_cached]
        ):
            committed_cached += 1
        s = self.sinks
        if committed_cached > s + evict:
            kept = committed_cached - evict
            self.k[:, s:kept] = self.k[:, s + evict : committed_cached].copy()
            self.v[:, s:kept] = self.v[:, s + evict : committed_cached].copy()
        else:
            kept = min(committed_cached, s)
        self.tokens = self.tokens[:s] + self.tokens[s + evict :]
        self.cached = self.tokens[:kept]
        self.evicted += evict

    def draft(self, k: int) -> list[int]:
        """Greedy draft of k tokens, feeding exactly what the engine feeds."""
        self.make_room(k)
        ctx = self.tokens
        valid = 0
        while valid < min(len(self.cached), len(ctx) - 1) and self.cached[valid] == ctx[valid]:
            valid += 1
        if valid < len(ctx) - 1:
            self.feed(ctx[valid:-1], valid)
        self.cached = list(ctx[:-1])
        out: list[int] = []
        feed, position = ctx[-1], len(ctx) - 1
        for _ in range(k):
            logits = self.feed([feed], position)
            self.cached.append(feed)
            feed, position = int(np.argmax(logits)), position + 1
            out.append(feed)
        return out
