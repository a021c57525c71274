"""``campplus.onnx`` with 3D-Speaker's CAM++ graph, from a CAMPPlus state dict.

Contract (as the official file): input ``input`` float32 [B, T, 80] (mean-normalized fbank),
output ``output`` float32 [B, 192]. No lengths: like the official model it pools over all T
frames, so callers pass one prompt per call (the official frontend does).

Naming follows the official export (module scope + op type): convs sit on
``/head/conv1/Conv``, ``/head/layer1/layer1.0/{conv1,conv2}/Conv``,
``/head/layer1/layer1.0/shortcut/shortcut.0/Conv``, ``/head/conv2/Conv``,
``/xvector/tdnn/linear/Conv``, ``/xvector/block{i}/tdnnd{j}/linear1/Conv`` and
``.../cam_layer/{linear_local,linear1,linear2}/Conv``, ``/xvector/transit{i}/linear/Conv``,
``/xvector/dense/linear/Conv``; BatchNorms on ``.../nonlinear1/batchnorm/BatchNormalization``,
``/xvector/transit{i}/nonlinear/batchnorm/...`` and ``/xvector/dense/nonlinear/batchnorm/...``. The exporter folded every BatchNorm that follows a
conv into it (out_nonlinear's into the last transit conv): those convs (the ones with a bias
in ``CAMPPlus``, outside the CAM layers) get opaque ``onnx::Conv_<n>``
weights and biases, every other tensor keeps its state-dict name, and the affine-free last
BatchNorm takes its scale (1) and shift (0) from Constant nodes.
"""

from __future__ import annotations

import numpy as np

from cosybatch.checkpoint.onnx_graph import GraphBuilder
from cosybatch.models.campplus import CAMPPlusConfig

def _folded(name: str, sd: dict) -> bool:
    """Convs carrying a folded BatchNorm: outside the CAM layers, exactly those with a bias."""
    return f"{name}.bias" in sd and ".cam_layer." not in name


def _conv(g: GraphBuilder, x: str, sd: dict, name: str, scope: str, **attrs) -> str:
    w = sd[f"{name}.weight"]
    opaque = _folded(name, sd)
    inputs = [x, g.param(w, None if opaque else f"{name}.weight", opaque_op="Conv")]
    if f"{name}.bias" in sd:
        inputs.append(g.param(sd[f"{name}.bias"], None if opaque else f"{name}.bias", opaque_op="Conv"))
    k = list(w.shape[2:])
    attrs.setdefault("pads", [((ki - 1) // 2) * d for ki, d in zip(k, attrs.get("dilations", [1] * len(k)))] * 2)
    return g.op("Conv", inputs, scope, kernel_shape=k, **attrs)


def _batchnorm(g: GraphBuilder, x: str, sd: dict, name: str, scope: str, eps: float, out_names=None) -> str:
    s = f"{scope}/batchnorm"
    if f"{name}.weight" in sd:
        scale, shift = g.param(sd[f"{name}.weight"], f"{name}.weight"), g.param(sd[f"{name}.bias"], f"{name}.bias")
    else:  # affine-free: the exporter writes the implied scale and shift as constants
        n = sd[f"{name}.running_mean"].shape[0]
        scale, shift = g.const(np.ones(n, np.float32), s), g.const(np.zeros(n, np.float32), s)
    mean = g.param(sd[f"{name}.running_mean"], f"{name}.running_mean")
    var = g.param(sd[f"{name}.running_var"], f"{name}.running_var")
    return g.op("BatchNormalization", [x, scale, shift, mean, var], s, out_names=out_names, epsilon=eps)


def _head(g: GraphBuilder, x: str, sd: dict, cfg: CAMPPlusConfig) -> str:
    x = g.op("Unsqueeze", [x, g.const(np.array([1], np.int64), "/head")], "/head")
    x = g.op("Relu", [_conv(g, x, sd, "head.conv1", "/head/conv1")], "/head")
    for layer, blocks in (("layer1", cfg.fcm_blocks[0]), ("layer2", cfg.fcm_blocks[1])):
        for j in range(blocks):
            p, s = f"head.{layer}.{j}", f"/head/{layer}/{layer}.{j}"
            stride = [2, 1] if j == 0 else [1, 1]
            out = g.op("Relu", [_conv(g, x, sd, f"{p}.conv1", f"{s}/conv1", strides=stride)], s)
            out = _conv(g, out, sd, f"{p}.conv2", f"{s}/conv2")
            if f"{p}.shortcut.0.weight" in sd:
                x = _conv(g, x, sd, f"{p}.shortcut.0", f"{s}/shortcut/shortcut.0", strides=stride, pads=[0, 0, 0, 0])
            x = g.op("Relu", [g.op("Add", [out, x], s)], s)
    x = g.op("Relu", [_conv(g, x, sd, "head.conv2", "/head/conv2", strides=[2, 1])], "/head")
    shape = g.op("Concat", [g.dim(x, 0, "/head"), g.const(np.array([-1], np.int64), "/head"), g.dim(x, 3, "/head")],
                 "/head", axis=0)
    return g.op("Reshape", [x, shape], "/head")  # [B, C, F/8, T] -> [B, C * F/8, T]


def _cam_layer(g: GraphBuilder, h: str, sd: dict, p: str, s: str, cfg: CAMPPlusConfig, dilation: int) -> str:
    y = _conv(g, h, sd, f"{p}.linear_local", f"{s}/linear_local", dilations=[dilation])
    mean = g.op("ReduceMean", [h], s, axes=[-1], keepdims=1)
    seg = g.op("AveragePool", [h], s, kernel_shape=[cfg.seg_len], strides=[cfg.seg_len], ceil_mode=1)
    rep = g.op("Expand", [g.op("Unsqueeze", [seg, g.const(np.array([-1], np.int64), s)], s),
                          g.const(np.array([1, 1, 1, cfg.seg_len], np.int64), s)], s)
    n_rep = g.op("Mul", [g.dim(seg, 2, s), g.const(np.array([cfg.seg_len], np.int64), s)], s)
    rep = g.op("Reshape", [rep, g.op("Concat", [g.dim(seg, 0, s), g.dim(seg, 1, s), n_rep], s, axis=0)], s)
    rep = g.op("Slice", [rep, g.const(np.array([0], np.int64), s), g.dim(h, 2, s), g.const(np.array([2], np.int64), s)], s)
    ctx = g.op("Add", [mean, rep], s)
    z = g.op("Relu", [_conv(g, ctx, sd, f"{p}.linear1", f"{s}/linear1")], f"{s}/relu")
    m = g.op("Sigmoid", [_conv(g, z, sd, f"{p}.linear2", f"{s}/linear2")], f"{s}/sigmoid")
    return g.op("Mul", [y, m], s)


def _stats(g: GraphBuilder, x: str) -> str:
    """mean and unbiased std over time, concatenated: [B, 2C]."""
    s = "/xvector/stats"
    mean = g.op("ReduceMean", [x], s, axes=[-1], keepdims=0)
    d = g.op("Sub", [x, g.op("ReduceMean", [x], s, axes=[-1], keepdims=1)], s)
    ss = g.op("ReduceSum", [g.op("Mul", [d, d], s), g.const(np.array([-1], np.int64), s)], s, keepdims=0)
    n = g.op("Cast", [g.dim(x, 2, s)], s, to=g.onnx.TensorProto.FLOAT)
    std = g.op("Sqrt", [g.op("Div", [ss, g.op("Sub", [n, g.const(np.float32(1.0), s)], s)], s)], s)
    return g.op("Concat", [mean, std], s, axis=1)


def campplus_graph(state: dict, cfg: CAMPPlusConfig, check: bool = True):
    """ModelProto of CAM++ with the weights of ``state`` (a CAMPPlus state dict)."""
    sd = {k: np.asarray(v.detach().cpu().float().numpy() if hasattr(v, "detach") else v, np.float32)
          for k, v in state.items() if not k.endswith("num_batches_tracked")}
    dense_bn = "xvector.dense.nonlinear.batchnorm"  # affine-free: scale/shift become constants
    g = GraphBuilder("campplus")
    x = g.op("Transpose", ["input"], perm=[0, 2, 1])
    x = _head(g, x, sd, cfg)
    x = _conv(g, x, sd, "xvector.tdnn.linear", "/xvector/tdnn/linear", strides=[2])
    x = g.op("Relu", [x], "/xvector/tdnn/nonlinear/relu")
    for i, (layers, dilation) in enumerate(zip(cfg.block_layers, cfg.dilations), start=1):
        for j in range(1, layers + 1):
            p, s = f"xvector.block{i}.tdnnd{j}", f"/xvector/block{i}/tdnnd{j}"
            h = _batchnorm(g, x, sd, f"{p}.nonlinear1.batchnorm", f"{s}/nonlinear1", cfg.bn_eps)
            h = g.op("Relu", [h], f"{s}/nonlinear1/relu")
            h = g.op("Relu", [_conv(g, h, sd, f"{p}.linear1", f"{s}/linear1")], f"{s}/nonlinear2/relu")
            x = g.op("Concat", [x, _cam_layer(g, h, sd, f"{p}.cam_layer", f"{s}/cam_layer", cfg, dilation)], f"/xvector/block{i}", axis=1)
        p, s = f"xvector.transit{i}", f"/xvector/transit{i}"
        x = g.op("Relu", [_batchnorm(g, x, sd, f"{p}.nonlinear.batchnorm", f"{s}/nonlinear", cfg.bn_eps)], f"{s}/nonlinear/relu")
        x = _conv(g, x, sd, f"{p}.linear", f"{s}/linear")
    x = g.op("Relu", [x], "/xvector/out_nonlinear/relu")  # its BatchNorm is folded into the last transit
    x = _stats(g, x)
    s = "/xvector/dense"
    x = g.op("Unsqueeze", [x, g.const(np.array([-1], np.int64), s)], s)
    x = g.op("Squeeze", [_conv(g, x, sd, "xvector.dense.linear", f"{s}/linear"), g.const(np.array([-1], np.int64), s)], s)
    _batchnorm(g, x, sd, dense_bn, f"{s}/nonlinear", cfg.bn_eps, out_names=["output"])
    tp = g.onnx.TensorProto
    inputs = [g.onnx.helper.make_tensor_value_info("input", tp.FLOAT, ["batch_size", "T", cfg.feat_dim])]
    outputs = [g.onnx.helper.make_tensor_value_info("output", tp.FLOAT, ["batch_size", cfg.embedding])]
    return g.model(inputs, outputs, check=check)


__all__ = ["campplus_graph"]
