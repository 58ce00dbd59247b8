"""The reference architecture as an ONNX graph, built with onnx.helper from an image.

Weights are not copied into the graph: every initializer is an external-data reference to its
bytes in the image file (tensors are 4096-aligned there), and onnxruntime reads them from the
file. Operators (onnxruntime CPU; tested with onnxruntime 1.32):

- ``com.microsoft.GroupQueryAttention`` with fused rotary (``do_rotary``) and one KV buffer per
  layer shared between past and present (``past_key`` and ``present_key`` bound to the same
  memory), so a decode step appends in place and copies nothing;
- ``SimplifiedLayerNormalization`` (RMSNorm) and ``com.microsoft.SkipSimplifiedLayerNormalization``
  (residual add + RMSNorm in one op);
- ``Gemm`` with ``transB`` on the stored [out, in] matrices (f32; f16 images are widened once at
  load), or ``com.microsoft.MatMulNBits`` with 8-bit weights for int8 images (run as int8).

Graph inputs: ``input_ids`` int64 [B, S]; ``seqlens_k`` int32 [B] (each row's total length after
this step, minus one); ``total_sequence_length`` int32 scalar; ``logit_rows`` int64 [M] (which of
the B*S positions to compute logits for); ``past_key_i``/``past_value_i`` float32
[B, kv_heads, positions, head_dim]. Outputs: ``logits`` [M, vocab] and ``present_key_i``/
``present_value_i`` (the same buffers).
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

from .rope import cos_sin_tables

OPSET = 17
INT8_BLOCK = 32
"""MatMulNBits block size along K; the image's per-row scale is repeated for every block."""

_ONNX_DTYPE = {
    DType.F32: TensorProto.FLOAT,
    DType.F16: TensorProto.FLOAT16,
    DType.I8: TensorProto.INT8,
}


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


def build_decoder(image: CardImage, positions: int) -> onnx.ModelProto:
    """The decoder graph for an image, with KV buffers of ``positions`` tokens per stream."""
    arch: DecoderConfig = image.arch
    g = GraphBuilder()
    file = Path(image.path).name if image.path else ""
    h, hd = arch.hidden_size, arch.head_dim
    nq, nkv = arch.num_heads * hd, arch.num_kv_heads * hd

    def weight(name: str) -> str:
        info = image.tensors[name]
        return g.external(name, info.dtype, info.shape, file, info.offset, info.size)

    def f32_weight(name: str) -> str:
        """A weight as float32 (f16 is widened once; onnxruntime folds the Cast at load)."""
        w = weight(name)
        if image.tensors[name].dtype == DType.F16:
            return g.op("Cast", [w], name + "_f32", to=TensorProto.FLOAT)[0]
        return w

    int8 = image.quant == "int8"

    def linear(x: str, name: str, bias: str | None = None) -> str:
        """x @ W^T (+ b) for a stored [out, in] matrix."""
        rows, cols = image.tensors[name].shape
        if int8:
            blocks = -(-cols // INT8_BLOCK)
            q = image.tensor(name)
            padded = np.full((rows, blocks * INT8_BLOCK), 0x80, dtype=np.uint8)
            padded[:, :cols] = q.view(np.uint8) ^ 0x80  # offset binary: zero point 128
            b = g.const(name + ".nbits", padded.reshape(rows, blocks, INT8_BLOCK))
            s = g.const(name + ".nbits_scale", np.repeat(image.tensor(name + ".scale"), blocks))
            y = g.op(
                "MatMulNBits",
                [x, b, s],
                name,
                domain="com.microsoft",
                K=cols,
                N=rows,
                bits=8,
                block_size=INT8_BLOCK,
                accuracy_level=0,
            )[0]
            return g.op("Add", [y, weight(bias)], name + "_bias")[0] if bias else y
        inputs = [x, f32_weight(name)] + ([weight(bias)] if bias else [])
        return g.op("Gemm", inputs, name, transB=1)[0]

    # ---------------------------------------------------------------- inputs
    g.inputs += [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("logit_rows", TensorProto.INT64, ["rows"]),
    ]
    kv_shape: list[str | int | None] = ["batch", arch.num_kv_heads, positions, hd]
    cos, sin = cos_sin_tables(arch, positions)
    cos_name, sin_name = g.const("rope_cos", cos), g.const("rope_sin", sin)

    shape = g.op("Shape", ["input_ids"], "ids_shape")[0]
    flat = g.const("flat_hidden", np.array([-1, h], np.int64))
    shape_q = g.op(
        "Concat", [shape, g.const("dim_q", np.array([nq], np.int64))], "shape_q", axis=0
    )[0]
    shape_kv = g.op(
        "Concat", [shape, g.const("dim_kv", np.array([nkv], np.int64))], "shape_kv", axis=0
    )[0]
    if arch.qk_norm:
        heads_q = g.const("heads_q", np.array([-1, arch.num_heads, hd], np.int64))
        heads_kv = g.const("heads_kv", np.array([-1, arch.num_kv_heads, hd], np.int64))

    # ---------------------------------------------------------------- embedding
    ids = g.op("Reshape", ["input_ids", g.const("flat_ids", np.array([-1], np.int64))], "ids")[0]
    if int8:
        rows = g.op("Gather", [weight("embed.weight"), ids], "embed_q", axis=0)[0]
        scale = g.op("Gather", [weight("embed.weight.scale"), ids], "embed_s", axis=0)[0]
        rows = g.op("Cast", [rows], "embed_f", to=TensorProto.FLOAT)[0]
        scale = g.op("Unsqueeze", [scale, g.const("axis1", np.array([1], np.int64))], "embed_su")[0]
        x = g.op("Mul", [rows, scale], "embed")[0]
    else:
        x = g.op("Gather", [weight("embed.weight"), ids], "embed", axis=0)[0]
        if image.tensors["embed.weight"].dtype == DType.F16:
            x = g.op("Cast", [x], "embed_f32", to=TensorProto.FLOAT)[0]
    x = g.op("Reshape", [x, flat], "x0")[0]  # [B*S, hidden]

    eps = float(arch.rms_norm_eps)
    normed = g.op(
        "SimplifiedLayerNormalization",
        [x, weight("layers.0.attn_norm.weight")],
        "n1_0",
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )[0]
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        q = linear(normed, p + "attn.q.weight", p + "attn.q.bias" if arch.qkv_bias else None)
        k = linear(normed, p + "attn.k.weight", p + "attn.k.bias" if arch.qkv_bias else None)
        v = linear(normed, p + "attn.v.weight", p + "attn.v.bias" if arch.qkv_bias else None)
        if arch.qk_norm:
            qh = g.op("Reshape", [q, heads_q], p + "q_heads")[0]
            q = g.op(
                "SimplifiedLayerNormalization",
                [qh, weight(p + "attn.q_norm.weight")],
                p + "q_norm",
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )[0]
            kh = g.op("Reshape", [k, heads_kv], p + "k_heads")[0]
            k = g.op(
                "SimplifiedLayerNormalization",
                [kh, weight(p + "attn.k_norm.weight")],
                p + "k_norm",
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )[0]
        q3 = g.op("Reshape", [q, shape_q], p + "q3")[0]
        k3 = g.op("Reshape", [k, shape_kv], p + "k3")[0]
        v3 = g.op("Reshape", [v, shape_kv], p + "v3")[0]
        past_k, past_v = f"past_key_{i}", f"past_value_{i}"
        present_k, present_v = f"present_key_{i}", f"present_value_{i}"
        g.inputs += [
            helper.make_tensor_value_info(past_k, TensorProto.FLOAT, kv_shape),
            helper.make_tensor_value_info(past_v, TensorProto.FLOAT, kv_shape),
        ]
        g.outputs += [
            helper.make_tensor_value_info(present_k, TensorProto.FLOAT, kv_shape),
            helper.make_tensor_value_info(present_v, TensorProto.FLOAT, kv_shape),
        ]
        attn = g.name(p + "attn")
        g.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    q3,
                    k3,
                    v3,
                    past_k,
                    past_v,
                    "seqlens_k",
                    "total_sequence_length",
                    cos_name,
                    sin_name,
                ],
                [attn, present_k, present_v],
                name=g.name(p + "gqa"),
                domain="com.microsoft",
                num_heads=arch.num_heads,
                kv_num_heads=arch.num_kv_heads,
                do_rotary=1,
                rotary_interleaved=0,
                local_window_size=arch.sliding_window or -1,
            )
        )
        attn2 = g.op(
            "Reshape", [attn, g.const(p + "flat_q", np.array([-1, nq], np.int64))], p + "attn2"
        )[0]
        o = linear(attn2, p + "attn.o.weight", p + "attn.o.bias" if arch.o_bias else None)
        n2, _, _, x = g.op(
            "SkipSimplifiedLayerNormalization",
            [o, x, weight(p + "mlp_norm.weight")],
            p + "n2",
            n_out=4,
            domain="com.microsoft",
            epsilon=eps,
        )
        gate = linear(n2, p + "mlp.gate.weight")
        up = linear(n2, p + "mlp.up.weight")
        act = g.op(
            "Mul",
            [g.op("Mul", [gate, g.op("Sigmoid", [gate], p + "sig")[0]], p + "silu")[0], up],
            p + "act",
        )[0]
        down = linear(act, p + "mlp.down.weight")
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

    last = g.op("Gather", [x, "logit_rows"], "logit_rows_x", axis=0)[0]
    final = g.op(
        "SimplifiedLayerNormalization",
        [last, weight("norm.weight")],
        "final_norm",
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )[0]
    head = "embed.weight" if arch.tie_embeddings else "lm_head.weight"
    logits = linear(final, head)
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
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
