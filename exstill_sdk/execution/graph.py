"""The reference architecture as an ONNX graph, built with onnx.helper from an image.

Weights are not copied into the graph: every f32/f16 initializer is an external-data reference to
its bytes in the image file (tensors are 4096-aligned there), and onnxruntime reads them from
the file (as for any model, it then lays matrices out for its GEMM kernels). Operators
(onnxruntime CPU; tested with onnxruntime 1.32):

- ``com.microsoft.GroupQueryAttention`` with fused rotary (``do_rotary``) and one KV buffer per
  layer shared between past and present (``past_key`` and ``present_key`` bound to the same
  memory), so a decode step appends in place and copies nothing;
- ``SimplifiedLayerNormalization`` (RMSNorm) and ``com.microsoft.SkipSimplifiedLayerNormalization``
  (residual add + RMSNorm in one op);
- ``MatMul`` on the stored [out, in] matrices through a ``Transpose`` (and for q, k, v a
  ``Concat``) of the initializers, which onnxruntime folds at load, and ``Gemm`` with ``transB``
  for the output projection; f16 images are widened to f32 once at load;
- ``com.microsoft.MatMulNBits`` with 8-bit weights and int8 compute for int8 images (the weights
  stay int8 in memory, re-laid out as offset binary once at load).

Graph inputs: ``input_ids`` int64 [B, S]; ``seqlens_k`` int32 [B] (each row's total length after
this step, minus one); ``total_sequence_length`` int32 scalar; ``logit_rows`` int64 [M] (which of
the B*S positions to compute logits for); ``past_key_i``/``past_value_i`` float32
[B, kv_heads, positions, head_dim]. Outputs: ``logits`` [M, vocab] and ``present_key_i``/
``present_value_i`` (the same buffers).

The slot graph (``slots=R``) scores tokens of up to R sequences in one run, each sequence any
number of tokens after its own past: ``input_ids`` [1, T] holds them end to end, slot b's
being [``slot_start_b``, ``slot_end_b``) with ``seqlens_k_b``/``total_sequence_length_b`` as
above and its own KV buffers ``past_key_i_b``/``past_value_i_b`` [1, kv_heads, positions,
head_dim] (row b); ``unslot`` [T] says where each token's attention output lies among the
slots' outputs (see ``_slot_attention``). Every matrix product runs once over all T tokens.

The tree graph (``tree=True``) is the decoder graph with two more inputs, for a token tree
scored in one run: ``position_ids`` int64 [B, S] (each token's rotary position: its depth in
the tree, not its cache slot) and ``attention_bias`` float32 [B, 1, S, total] (0 where a token
may look, -inf where not: each node sees the context and its own ancestors only). With both
(``slots=R, tree=True``), each slot takes its own ``position_ids_b`` [1, S_b] and
``attention_bias_b`` [1, 1, S_b, total_b]: chains and trees of several sequences in one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from exstill_sdk.image.arch import DecoderConfig
from exstill_sdk.image.format import DType
from exstill_sdk.image.reader import CardImage
from exstill_sdk.image.rope import cos_sin_tables

OPSET = 17
INT8_BLOCK = 32
"""MatMulNBits block size along K; the image's per-row scale is repeated for every block."""
INT8_ACCURACY_LEVEL = 4
"""MatMulNBits computes int8 x int8: activations are quantised to int8 per block of 32 on the
fly. About 100x faster on CPU than level 0 (which dequantises the weights every call) at the
cost of activation rounding; see docs/emulator.md for the bound the tests check."""

_ONNX_DTYPE = {
    DType.F32: TensorProto.FLOAT,
    DType.F16: TensorProto.FLOAT16,
    DType.I8: TensorProto.INT8,
}


def int8_blocks(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An image's int8 rows (symmetric, one scale per row) in MatMulNBits' 8-bit layout:
    offset binary (zero point 128) in blocks of INT8_BLOCK along K, padded with zeros, the row's
    scale repeated for every block. One byte per weight, as in the image."""
    rows, cols = q.shape
    blocks = -(-cols // INT8_BLOCK)
    padded = np.full((rows, blocks * INT8_BLOCK), 0x80, dtype=np.uint8)
    padded[:, :cols] = q.view(np.uint8) ^ 0x80
    return padded.reshape(rows, blocks, INT8_BLOCK), np.repeat(scale, blocks)


def int8_attributes(shape: tuple[int, ...]) -> dict[str, Any]:
    """MatMulNBits attributes for an int8 matrix of ``shape`` [N, K] (int8 compute)."""
    rows, cols = shape
    return dict(
        domain="com.microsoft",
        K=cols,
        N=rows,
        bits=8,
        block_size=INT8_BLOCK,
        accuracy_level=INT8_ACCURACY_LEVEL,
    )


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers; names are unique by construction."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(
        self,
        op_type: str,
        inputs: list[str],
        hint: str,
        n_out: int = 1,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        outs = [self.name(f"{hint}_out{i}") for i in range(n_out)]
        self.nodes.append(
            helper.make_node(op_type, inputs, outs, name=self.name(hint), domain=domain, **attrs)
        )
        return outs

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def external(
        self, name: str, dtype: int, shape: tuple[int, ...], file: str, offset: int, size: int
    ) -> str:
        t = TensorProto()
        t.name = name
        t.data_type = _ONNX_DTYPE[dtype]
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", file), ("offset", str(offset)), ("length", str(size))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(t)
        return name


def build_decoder(
    image: CardImage, positions: int, slots: int = 0, tree: bool = False
) -> onnx.ModelProto:
    """The decoder graph for an image, with KV buffers of ``positions`` tokens per stream;
    with ``slots``, the slot graph (module docstring) over that many KV rows; with ``tree``,
    the tree graph (with ``slots`` too: each slot's own position ids and bias)."""
    arch: DecoderConfig = image.arch
    g = GraphBuilder()
    file = Path(image.path).name if image.path else ""
    hd = arch.head_dim
    nq, nkv = arch.num_heads * hd, arch.num_kv_heads * hd
    eps = float(arch.rms_norm_eps)
    int8 = image.quant == "int8"

    declared: set[str] = set()

    def weight(name: str) -> str:
        """An image tensor as an initializer, declared once however often it is used (a tied
        embedding is both the input table and the output projection)."""
        if name not in declared:
            info = image.tensors[name]
            g.external(name, info.dtype, info.shape, file, info.offset, info.size)
            declared.add(name)
        return name

    def f32_weight(name: str) -> str:
        """A weight as float32 (f16 is widened; onnxruntime folds the Cast at load)."""
        w = weight(name)
        if image.tensors[name].dtype == DType.F16:
            return g.op("Cast", [w], name + "_f32", to=TensorProto.FLOAT)[0]
        return w

    def int8_matmul(x: str, names: list[str]) -> str:
        """x @ W^T for int8 matrices stacked by rows (q, k and v share one product)."""
        q = np.concatenate([image.tensor(n) for n in names])
        scale = np.concatenate([image.tensor(n + ".scale") for n in names])
        packed, scales = int8_blocks(q, scale)
        b = g.const(names[0] + ".nbits", packed)
        s = g.const(names[0] + ".nbits_scale", scales)
        return g.op("MatMulNBits", [x, b, s], names[0], **int8_attributes(q.shape))[0]

    def linear(x: str, names: list[str], biases: list[str] | None = None) -> str:
        """x @ [W1; W2; ...]^T (+ b) for stored [out, in] matrices, several stacked into one
        product (q, k and v). onnxruntime folds the Concat/Transpose of initializers at load."""
        if int8:
            y = int8_matmul(x, names)
        else:
            ws = [f32_weight(n) for n in names]
            w = ws[0] if len(ws) == 1 else g.op("Concat", ws, names[0] + "_stack", axis=0)[0]
            y = g.op(
                "MatMul", [x, g.op("Transpose", [w], names[0] + "_t", perm=[1, 0])[0]], names[0]
            )[0]
        if biases:
            bs = [weight(b) for b in biases]
            b = bs[0] if len(bs) == 1 else g.op("Concat", bs, biases[0] + "_stack", axis=0)[0]
            y = g.op("Add", [y, b], names[0] + "_bias")[0]
        return y

    def rms_norm(x: str, w: str, hint: str) -> str:
        return g.op(
            "SimplifiedLayerNormalization", [x, weight(w)], hint, axis=-1, epsilon=eps, stash_type=1
        )[0]

    # ---------------------------------------------------------------- inputs
    g.inputs += [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("logit_rows", TensorProto.INT64, ["rows"]),
    ]
    if slots:
        g.inputs.append(helper.make_tensor_value_info("unslot", TensorProto.INT64, ["seq"]))
        for b in range(slots):
            g.inputs += [
                helper.make_tensor_value_info(f"slot_start_{b}", TensorProto.INT64, [1]),
                helper.make_tensor_value_info(f"slot_end_{b}", TensorProto.INT64, [1]),
                helper.make_tensor_value_info(f"seqlens_k_{b}", TensorProto.INT32, [1]),
                helper.make_tensor_value_info(f"total_sequence_length_{b}", TensorProto.INT32, []),
            ]
    else:
        g.inputs += [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        ]
    if tree and slots:
        for b in range(slots):
            g.inputs += [
                helper.make_tensor_value_info(
                    f"position_ids_{b}", TensorProto.INT64, [1, f"seq_{b}"]
                ),
                helper.make_tensor_value_info(
                    f"attention_bias_{b}", TensorProto.FLOAT, [1, 1, f"seq_{b}", f"total_{b}"]
                ),
            ]
    elif tree:
        g.inputs += [
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info(
                "attention_bias", TensorProto.FLOAT, ["batch", 1, "seq", "total"]
            ),
        ]
    kv_shape: list[str | int | None] = ["batch", arch.num_kv_heads, positions, hd]
    cos, sin = cos_sin_tables(arch, positions)
    rope = (g.const("rope_cos", cos), g.const("rope_sin", sin))
    if slots:
        g.const("slot_axis", np.array([1], np.int64))

    # ---------------------------------------------------------------- embedding: [B, S, hidden]
    if int8:
        rows = g.op("Gather", [weight("embed.weight"), "input_ids"], "embed_q", axis=0)[0]
        scale = g.op("Gather", [weight("embed.weight.scale"), "input_ids"], "embed_s", axis=0)[0]
        rows = g.op("Cast", [rows], "embed_f", to=TensorProto.FLOAT)[0]
        scale = g.op(
            "Unsqueeze", [scale, g.const("last_axis", np.array([-1], np.int64))], "embed_su"
        )[0]
        x = g.op("Mul", [rows, scale], "embed")[0]
    else:
        x = g.op("Gather", [weight("embed.weight"), "input_ids"], "embed", axis=0)[0]
        if image.tensors["embed.weight"].dtype == DType.F16:
            x = g.op("Cast", [x], "embed_f32", to=TensorProto.FLOAT)[0]

    normed = rms_norm(x, "layers.0.attn_norm.weight", "n1_0")
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        qkv_names = [p + "attn.q.weight", p + "attn.k.weight", p + "attn.v.weight"]
        qkv_bias = (
            [p + "attn.q.bias", p + "attn.k.bias", p + "attn.v.bias"] if arch.qkv_bias else None
        )
        if arch.qk_norm:  # q and k are normalised per head before the rotary embedding
            q = linear(normed, qkv_names[:1], qkv_bias[:1] if qkv_bias else None)
            k = linear(normed, qkv_names[1:2], qkv_bias[1:2] if qkv_bias else None)
            v = linear(normed, qkv_names[2:], qkv_bias[2:] if qkv_bias else None)
            heads_q = g.const(p + "heads_q", np.array([0, 0, arch.num_heads, hd], np.int64))
            heads_kv = g.const(p + "heads_kv", np.array([0, 0, arch.num_kv_heads, hd], np.int64))
            q = rms_norm(
                g.op("Reshape", [q, heads_q], p + "q_heads")[0],
                p + "attn.q_norm.weight",
                p + "q_norm",
            )
            k = rms_norm(
                g.op("Reshape", [k, heads_kv], p + "k_heads")[0],
                p + "attn.k_norm.weight",
                p + "k_norm",
            )
            q = g.op(
                "Reshape", [q, g.const(p + "flat_q", np.array([0, 0, nq], np.int64))], p + "q3"
            )[0]
            k = g.op(
                "Reshape", [k, g.const(p + "flat_k", np.array([0, 0, nkv], np.int64))], p + "k3"
            )[0]
            attention_inputs = [q, k, v]
        else:  # one product for q, k and v, handed to attention packed
            attention_inputs = [linear(normed, qkv_names, qkv_bias), "", ""]
        if slots:
            attn = _slot_attention(g, attention_inputs, i, slots, arch, rope, tree)
        else:
            attn = _attention(
                g,
                attention_inputs,
                f"{i}",
                "seqlens_k",
                "total_sequence_length",
                kv_shape,
                arch,
                rope,
                ("position_ids", "attention_bias") if tree else (),
            )
        o = linear(attn, [p + "attn.o.weight"], [p + "attn.o.bias"] if arch.o_bias else None)
        n2, _, _, x = g.op(
            "SkipSimplifiedLayerNormalization",
            [o, x, weight(p + "mlp_norm.weight")],
            p + "n2",
            n_out=4,
            domain="com.microsoft",
            epsilon=eps,
        )
        gate = linear(n2, [p + "mlp.gate.weight"])
        up = linear(n2, [p + "mlp.up.weight"])
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], p + "sig")[0]], p + "silu")[0]
        down = linear(g.op("Mul", [silu, up], p + "act")[0], [p + "mlp.down.weight"])
        if i + 1 < arch.num_layers:
            normed, _, _, x = g.op(
                "SkipSimplifiedLayerNormalization",
                [down, x, weight(f"layers.{i + 1}.attn_norm.weight")],
                f"layers.{i + 1}.n1",
                n_out=4,
                domain="com.microsoft",
                epsilon=eps,
            )
        else:
            x = g.op("Add", [x, down], p + "residual")[0]

    flat = g.op(
        "Reshape", [x, g.const("flat_hidden", np.array([-1, arch.hidden_size], np.int64))], "flat"
    )[0]
    final = rms_norm(
        g.op("Gather", [flat, "logit_rows"], "logit_rows_x", axis=0)[0], "norm.weight", "final_norm"
    )
    head = "embed.weight" if arch.tie_embeddings and not arch.head_size else "lm_head.weight"
    if int8:
        int8_matmul(final, [head])
    else:
        g.op("Gemm", [final, f32_weight(head)], "lm_head", transB=1)
    if image.head_ids is not None:
        _spread_head(g, g.nodes[-1].output[0], image.head_ids, arch.vocab_size)
    g.nodes[-1].output[0] = "logits"  # the last op writes the graph output
    g.outputs.insert(
        0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", arch.vocab_size])
    )
    graph = helper.make_graph(g.nodes, "exstill_decoder", g.inputs, g.outputs, g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="exstill-firmware",
    )
    model.ir_version = 9
    return model


def _spread_head(g: GraphBuilder, head_logits: str, ids: np.ndarray, vocab: int) -> None:
    """A frequency-ranked head's logits [M, head] to the whole vocabulary's [M, vocab]: each
    target id takes its head row's logit, or minus infinity (probability 0) from a column
    appended for the ids the head lacks, so everything after the graph sees target ids."""
    column = np.full(vocab, len(ids), np.int64)
    column[ids] = np.arange(len(ids))
    padded = g.op(
        "Pad",
        [
            head_logits,
            g.const("head_pads", np.array([0, 0, 0, 1], np.int64)),
            g.const("head_absent", np.array(-np.inf, np.float32)),
        ],
        "head_padded",
    )[0]
    g.op("Gather", [padded, g.const("head_columns", column)], "head_spread", axis=1)


def _attention(
    g: GraphBuilder,
    inputs: list[str],
    suffix: str,
    seqlens: str,
    total: str,
    kv_shape: list[str | int | None],
    arch: DecoderConfig,
    rope: tuple[str, str],
    tree: tuple[str, ...] = (),
) -> str:
    """GroupQueryAttention over the KV buffers ``past_key_{suffix}``/``past_value_{suffix}``,
    which are also its present outputs (bound to the same memory: appended in place); with
    ``tree``, the position ids and attention bias of the tree graph."""
    past_k, past_v = f"past_key_{suffix}", f"past_value_{suffix}"
    present_k, present_v = f"present_key_{suffix}", f"present_value_{suffix}"
    g.inputs += [
        helper.make_tensor_value_info(past_k, TensorProto.FLOAT, kv_shape),
        helper.make_tensor_value_info(past_v, TensorProto.FLOAT, kv_shape),
    ]
    g.outputs += [
        helper.make_tensor_value_info(present_k, TensorProto.FLOAT, kv_shape),
        helper.make_tensor_value_info(present_v, TensorProto.FLOAT, kv_shape),
    ]
    attn = g.name(f"attn_{suffix}")
    g.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [*inputs, past_k, past_v, seqlens, total, *rope, *tree],
            [attn, present_k, present_v],
            name=g.name(f"gqa_{suffix}"),
            domain="com.microsoft",
            num_heads=arch.num_heads,
            kv_num_heads=arch.num_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            local_window_size=arch.sliding_window or -1,
        )
    )
    return attn


def _slot_attention(
    g: GraphBuilder,
    inputs: list[str],
    layer: int,
    slots: int,
    arch: DecoderConfig,
    rope: tuple[str, str],
    tree: bool = False,
) -> str:
    """Attention for tokens of several sequences laid end to end in one row ([1, T, ...]).

    onnxruntime's GroupQueryAttention takes several tokens with past context only for a
    batch of one, so each slot (KV row) gets its own node, on its tokens
    [slot_start_b, slot_end_b) of the row; the matrix products around it stay one product over
    all T tokens, which is what reads the weights once. A slot with no tokens in a call is
    handed one token (the row's first) to score at a position past its row's data, so that
    its output is thrown away (``unslot`` picks the real tokens out of the slots' outputs, laid
    end to end) and what it writes lands where nothing valid is kept. With ``tree``, each
    slot's node takes its own position ids and attention bias."""
    outs = []
    for b in range(slots):
        sliced = [
            g.op("Slice", [x, f"slot_start_{b}", f"slot_end_{b}", "slot_axis"], f"slot{b}_{layer}")[
                0
            ]
            if x
            else ""
            for x in inputs
        ]
        outs.append(
            _attention(
                g,
                sliced,
                f"{layer}_{b}",
                f"seqlens_k_{b}",
                f"total_sequence_length_{b}",
                [1, arch.num_kv_heads, f"cache_{b}", arch.head_dim],
                arch,
                rope,
                (f"position_ids_{b}", f"attention_bias_{b}") if tree else (),
            )
        )
    laid = g.op("Concat", outs, f"slots_{layer}", axis=1)[0]
    return g.op("Gather", [laid, "unslot"], f"unslot_{layer}", axis=1)[0]
