"""``speech_tokenizer_v3.onnx`` with the official S3TokenizerV3 graph, from a state dict.

Contract (as the official file): inputs ``feats`` float32 [B, 128, T] whisper log-mel and
``feats_length`` int32 [B]; output ``indices`` int32 [B, ceil(T/4)], codes in [0, 6561).

Naming follows the official export (module scope + op type, see ``onnx_graph``): the weights a
loader reads sit on ``/conv1/Conv`` and ``/conv2/Conv`` (inputs 1, 2), per block N on
``/blocks.N/attn/{query,value,out}/MatMul`` + ``.../Add``, ``/blocks.N/attn/key/MatMul`` (no
bias), ``/blocks.N/attn/fsmn_block/Conv``, ``/blocks.N/{attn_ln,mlp_ln}/Mul`` (gain) and
``.../Add_1`` (shift), ``/blocks.N/mlp/mlp.{0,2}/MatMul`` + ``Add``, and
``/quantizer/project_in/MatMul`` + ``Add``. Like the official file, the only initializers are
the 16 x layers + 6 parameters (198 at full size, 242,009,608 values); the rotary tables and
every other constant are Constant nodes. Lengths are honoured the way the official graph does:
conv inputs are zeroed past each row's length, attention adds -1e10 on padded keys, and the
FSMN memory conv reads masked values.
"""

from __future__ import annotations

import numpy as np

from cosybatch.checkpoint.onnx_graph import GraphBuilder
from cosybatch.models.s3tokenizer import ATTN_MASK_VALUE, FSQ_SCALE, S3TokenizerConfig, rotary_tables

_BIG = np.iinfo(np.int64).max


def _valid_mask(g: GraphBuilder, lengths: str, x: str, axis: int) -> str:
    """bool [B, x.shape[axis]]: position < length."""
    t = g.op("Gather", [g.op("Shape", [x]), g.const(np.int64(axis))], axis=0)
    r = g.op("Range", [g.const(np.int64(0)), t, g.const(np.int64(1))])
    r = g.op("Unsqueeze", [r, g.const(np.array([0], np.int64))])
    return g.op("Less", [r, g.op("Unsqueeze", [lengths, g.const(np.array([1], np.int64))])])


def _as_float(g: GraphBuilder, mask: str, axes: list[int]) -> str:
    f = g.op("Cast", [mask], to=g.onnx.TensorProto.FLOAT)
    return g.op("Unsqueeze", [f, g.const(np.array(axes, np.int64))])


def _conv_lengths(g: GraphBuilder, lengths: str) -> str:
    """(L - 1) // 2 + 1 (integer Div truncates; L >= 1)."""
    one = g.const(np.array([1], np.int64))
    d = g.op("Div", [g.op("Sub", [lengths, one]), g.const(np.array([2], np.int64))])
    return g.op("Add", [d, g.const(np.array([1], np.int64))])


def _subsample(g: GraphBuilder, x: str, lengths: str, sd: dict, name: str) -> str:
    """x * mask(lengths) -> ``/<name>/Conv`` (k3, s2, p1) -> GELU."""
    xm = g.op("Mul", [x, _as_float(g, _valid_mask(g, lengths, x, 2), [1])])
    w = g.param(sd[f"{name}.weight"], opaque_op="Conv")
    b = g.param(sd[f"{name}.bias"], opaque_op="Conv")
    y = g.op("Conv", [xm, w, b], f"/{name}", kernel_shape=[3], strides=[2], pads=[1, 1])
    return g.gelu(y, "")


def _rotate(g: GraphBuilder, x: str, cos: str, sin: str, half: int, scope: str) -> str:
    axes = g.const(np.array([3], np.int64), scope)
    left = g.op("Slice", [x, g.const(np.array([0], np.int64), scope), g.const(np.array([half], np.int64), scope), axes], scope)
    right = g.op("Slice", [x, g.const(np.array([half], np.int64), scope), g.const(np.array([_BIG], np.int64), scope), axes], scope)
    rot = g.op("Concat", [g.op("Neg", [right], scope), left], scope, axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], scope), g.op("Mul", [rot, sin], scope)], scope)


def _attention(g: GraphBuilder, h: str, sd: dict, cfg: S3TokenizerConfig, n: int, ctx: dict) -> str:
    s, p = f"/blocks.{n}/attn", f"blocks.{n}.attn"
    q = g.linear(h, sd[f"{p}.query.weight"], sd[f"{p}.query.bias"], f"{s}/query", f"{p}.query.bias")
    k = g.linear(h, sd[f"{p}.key.weight"], None, f"{s}/key", None)
    v = g.linear(h, sd[f"{p}.value.weight"], sd[f"{p}.value.bias"], f"{s}/value", f"{p}.value.bias")
    b, t = g.dim(h, 0, s), g.dim(h, 1, s)
    heads = g.const(np.array([cfg.heads], np.int64), s)
    shape4 = g.op("Concat", [b, t, heads, g.const(np.array([-1], np.int64), s)], s, axis=0)
    q4, k4, v4 = (g.op("Reshape", [z, shape4], s) for z in (q, k, v))
    half = cfg.head_dim // 2
    q4 = _rotate(g, q4, ctx["cos"], ctx["sin"], half, s)
    k4 = _rotate(g, k4, ctx["cos"], ctx["sin"], half, s)
    # FSMN memory over the masked values: pad (k-1)/2 both sides, depthwise conv, + values
    vm = g.op("Mul", [v, ctx["keep"]], s)
    pad = (cfg.fsmn_kernel - 1) // 2
    vp = g.op("Pad", [g.op("Transpose", [vm], s, perm=[0, 2, 1]), g.const(np.array([0, 0, pad, 0, 0, pad], np.int64), s)],
              s, mode="constant")
    w = g.param(sd[f"{p}.fsmn_block.weight"], f"{p}.fsmn_block.weight")
    conv = g.op("Conv", [vp, w], f"{s}/fsmn_block", kernel_shape=[cfg.fsmn_kernel], group=cfg.dim)
    mem = g.op("Mul", [g.op("Add", [g.op("Transpose", [conv], s, perm=[0, 2, 1]), vm], s), ctx["keep"]], s)
    scale = g.const(np.float32(cfg.head_dim ** -0.25), s)
    qs = g.op("Mul", [g.op("Transpose", [q4], s, perm=[0, 2, 1, 3]), scale], s)
    ks = g.op("Mul", [g.op("Transpose", [k4], s, perm=[0, 2, 3, 1]), scale], s)
    scores = g.op("Add", [g.op("MatMul", [qs, ks], s), ctx["bias"]], s)
    probs = g.op("Softmax", [scores], s, axis=-1)
    o = g.op("MatMul", [probs, g.op("Transpose", [v4], s, perm=[0, 2, 1, 3])], s)
    shape3 = g.op("Concat", [b, t, g.const(np.array([-1], np.int64), s)], s, axis=0)
    o = g.op("Reshape", [g.op("Transpose", [o], s, perm=[0, 2, 1, 3]), shape3], s)
    o = g.linear(o, sd[f"{p}.out.weight"], sd[f"{p}.out.bias"], f"{s}/out", f"{p}.out.bias")
    return g.op("Add", [o, mem], s)


def _block(g: GraphBuilder, x: str, sd: dict, cfg: S3TokenizerConfig, n: int, ctx: dict) -> str:
    s, p = f"/blocks.{n}", f"blocks.{n}"
    h = g.layer_norm(x, sd[f"{p}.attn_ln.weight"], sd[f"{p}.attn_ln.bias"], cfg.attn_ln_eps, f"{s}/attn_ln", f"{p}.attn_ln")
    x = g.op("Add", [x, _attention(g, h, sd, cfg, n, ctx)], s)
    h = g.layer_norm(x, sd[f"{p}.mlp_ln.weight"], sd[f"{p}.mlp_ln.bias"], cfg.mlp_ln_eps, f"{s}/mlp_ln", f"{p}.mlp_ln")
    h = g.linear(h, sd[f"{p}.mlp.0.weight"], sd[f"{p}.mlp.0.bias"], f"{s}/mlp/mlp.0", f"{p}.mlp.0.bias")
    h = g.gelu(h, f"{s}/mlp/mlp.1")
    h = g.linear(h, sd[f"{p}.mlp.2.weight"], sd[f"{p}.mlp.2.bias"], f"{s}/mlp/mlp.2", f"{p}.mlp.2.bias")
    return g.op("Add", [x, h], s)


def _quantize(g: GraphBuilder, x: str, sd: dict, cfg: S3TokenizerConfig) -> str:
    s = "/quantizer"
    h = g.linear(x, sd["quantizer.project_in.weight"], sd["quantizer.project_in.bias"], f"{s}/project_in",
                 "quantizer.project_in.bias")
    h = g.op("Round", [g.op("Mul", [g.op("Tanh", [h], s), g.const(np.float32(FSQ_SCALE), s)], s)], s)
    digits = g.op("Add", [h, g.const(np.float32(1.0), s)], s)
    powers = g.const((3.0 ** np.arange(cfg.fsq_digits)).astype(np.float32), s)
    code = g.op("ReduceSum", [g.op("Mul", [digits, powers], s), g.const(np.array([-1], np.int64), s)], s, keepdims=0)
    return g.op("Cast", [code], s, out_names=["indices"], to=g.onnx.TensorProto.INT32)


def tokenizer_graph(state: dict, cfg: S3TokenizerConfig, check: bool = True):
    """ModelProto of S3TokenizerV3 with the weights of ``state`` (an S3TokenizerV3 state dict)."""
    sd = {k: np.asarray(v.detach().cpu().float().numpy() if hasattr(v, "detach") else v, np.float32)
          for k, v in state.items()}
    g = GraphBuilder("speech_tokenizer_v3")
    tp = g.onnx.TensorProto
    lengths = g.op("Cast", ["feats_length"], to=tp.INT64)
    x = _subsample(g, "feats", lengths, sd, "conv1")
    lengths = _conv_lengths(g, lengths)
    x = _subsample(g, x, lengths, sd, "conv2")
    lengths = _conv_lengths(g, lengths)
    valid = _valid_mask(g, lengths, x, 2)
    x = g.op("Transpose", [x], perm=[0, 2, 1])
    keep = _as_float(g, valid, [2])  # [B, T, 1]
    pad = g.op("Sub", [g.const(np.float32(1.0)), g.op("Cast", [valid], to=tp.FLOAT)])
    bias = g.op("Unsqueeze", [g.op("Mul", [pad, g.const(np.float32(ATTN_MASK_VALUE))]), g.const(np.array([1, 2], np.int64))])
    cos_t, sin_t = rotary_tables(cfg.head_dim, cfg.max_positions)
    t = g.dim(x, 1, "")
    rope = []
    for table in (cos_t, sin_t):
        sl = g.op("Slice", [g.const(table.numpy()), g.const(np.array([0], np.int64)), t, g.const(np.array([0], np.int64))])
        rope.append(g.op("Unsqueeze", [sl, g.const(np.array([0, 2], np.int64))]))
    ctx = {"keep": keep, "bias": bias, "cos": rope[0], "sin": rope[1]}
    for n in range(cfg.layers):
        x = _block(g, x, sd, cfg, n, ctx)
    _quantize(g, x, sd, cfg)
    inputs = [
        g.onnx.helper.make_tensor_value_info("feats", tp.FLOAT, ["batch_size", cfg.n_mels, "T"]),
        g.onnx.helper.make_tensor_value_info("feats_length", tp.INT32, ["batch_size"]),
    ]
    outputs = [g.onnx.helper.make_tensor_value_info("indices", tp.INT32, ["batch_size", "T_tokens"])]
    return g.model(inputs, outputs, check=check)


__all__ = ["tokenizer_graph"]
