"""Load ``speech_tokenizer_v3.onnx`` / ``campplus.onnx`` into the PyTorch models.

Weights are found the way they are laid out in the official exports (see ``onnx_tokenizer`` and
``onnx_campplus``): by node name (module scope + op type) and input position, never by
initializer name, because the exporter gives transposed and BatchNorm-folded weights opaque
``onnx::<Op>_<n>`` names. The dimensions come from the weight shapes, the head count from the
attention reshape's constant, LayerNorm/BatchNorm epsilons from the graph, so any size loads.

A file without that structure (e.g. a small stand-in with only the I/O contract) raises
``FrontendModelError`` naming what is missing; callers fall back to onnxruntime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cosybatch.models.campplus import CAMPPlus, CAMPPlusConfig
from cosybatch.models.s3tokenizer import S3TokenizerConfig, S3TokenizerV3


class FrontendModelError(ValueError):
    """An ONNX frontend file that does not have the structure the PyTorch models implement."""


@dataclass
class OnnxGraph:
    path: str
    nodes: dict  # name -> NodeProto
    inits: dict  # initializer name -> np.ndarray
    consts: dict  # Constant output name -> np.ndarray
    inputs: list  # ValueInfoProto
    outputs: list

    @classmethod
    def read(cls, path) -> "OnnxGraph":
        """The graph at ``path``, its initializers read-only views of the file (``onnx_file``)."""
        from onnx import numpy_helper

        from cosybatch.checkpoint.onnx_file import read_onnx

        try:
            f = read_onnx(path)
        except Exception as e:  # protobuf raises several types for a damaged file
            raise FrontendModelError(f"{path}: not a readable ONNX model ({e})") from e
        g = f.graph
        consts = {}
        for n in g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        return cls(str(path), {n.name: n for n in g.node}, f.initializers, consts, list(g.input), list(g.output))

    def node(self, name: str, what: str):
        n = self.nodes.get(name)
        if n is None:
            raise FrontendModelError(f"{self.path}: not the {what} structure (no node {name!r})")
        return n

    def value(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return self.inits[name]
        return self.consts.get(name)

    def weight(self, node_name: str, what: str, index: int | None = None, transposed: bool = False) -> torch.Tensor:
        """The parameter input of a node: at ``index``, or its only initializer input; with
        ``transposed``, its transpose (a MatMul's [in, out] as a Linear's [out, in]). A float32
        initializer comes back as a view of the file, not a copy: the model's load makes the
        one copy (on its device), and a ~1 GB tokenizer copied twice cost seconds of start-up."""
        n = self.node(node_name, what)
        cands = [i for i in n.input if i in self.inits] if index is None else (
            [n.input[index]] if index < len(n.input) and n.input[index] in self.inits else [])
        if len(cands) != 1:
            raise FrontendModelError(f"{self.path}: node {node_name!r} has no single weight input ({what})")
        src = self.inits[cands[0]]
        if src.dtype != np.float32 or not src.flags.writeable:
            src = src.astype(np.float32)
        t = torch.from_numpy(src)
        return t.t() if transposed else t

    def io_names(self) -> tuple[list[str], list[str]]:
        return [i.name for i in self.inputs], [o.name for o in self.outputs]


# ---- S3TokenizerV3 -----------------------------------------------------------------------
_TOK = "S3TokenizerV3"


def _scalar_const(g: OnnxGraph, node_name: str, index: int, default: float) -> float:
    n = g.nodes.get(node_name)
    v = g.value(n.input[index]) if n is not None and len(n.input) > index else None
    return float(np.asarray(v).reshape(-1)[0]) if v is not None and np.asarray(v).size == 1 else default


def s3tokenizer_state(g: OnnxGraph) -> tuple[S3TokenizerConfig, dict]:
    """Config and state dict of an S3TokenizerV3 graph (raises FrontendModelError)."""
    ins, outs = g.io_names()
    if ins[:2] != ["feats", "feats_length"] or outs[:1] != ["indices"]:
        raise FrontendModelError(f"{g.path}: not the speech tokenizer contract (inputs {ins}, outputs {outs})")
    conv1 = g.weight("/conv1/Conv", _TOK, 1)
    layers = 0
    while f"/blocks.{layers}/attn/query/MatMul" in g.nodes:
        layers += 1
    if layers == 0:
        raise FrontendModelError(f"{g.path}: not the {_TOK} structure (no node '/blocks.0/attn/query/MatMul')")
    dim, n_mels = conv1.shape[0], conv1.shape[1]
    heads = int(_scalar_const(g, "/blocks.0/attn/Concat", 2, dim // 64))  # the view(B, T, heads, -1)
    state = {
        "conv1.weight": conv1, "conv1.bias": g.weight("/conv1/Conv", _TOK, 2),
        "conv2.weight": g.weight("/conv2/Conv", _TOK, 1), "conv2.bias": g.weight("/conv2/Conv", _TOK, 2),
        "quantizer.project_in.weight": g.weight("/quantizer/project_in/MatMul", _TOK, transposed=True),
        "quantizer.project_in.bias": g.weight("/quantizer/project_in/Add", _TOK),
    }
    for n in range(layers):
        s, p = f"/blocks.{n}", f"blocks.{n}"
        for lin in ("attn/query", "attn/key", "attn/value", "attn/out", "mlp/mlp.0", "mlp/mlp.2"):
            key = f"{p}.{lin.replace('/', '.').replace('mlp.mlp', 'mlp')}"
            state[f"{key}.weight"] = g.weight(f"{s}/{lin}/MatMul", _TOK, transposed=True)
            if lin != "attn/key":  # whisper's key projection has no bias
                state[f"{key}.bias"] = g.weight(f"{s}/{lin}/Add", _TOK)
        state[f"{p}.attn.fsmn_block.weight"] = g.weight(f"{s}/attn/fsmn_block/Conv", _TOK, 1)
        for ln in ("attn_ln", "mlp_ln"):
            state[f"{p}.{ln}.weight"] = g.weight(f"{s}/{ln}/Mul", _TOK)
            state[f"{p}.{ln}.bias"] = g.weight(f"{s}/{ln}/Add_1", _TOK)
    cfg = S3TokenizerConfig(
        n_mels=n_mels, dim=dim, heads=heads, layers=layers,
        fsmn_kernel=state["blocks.0.attn.fsmn_block.weight"].shape[-1],
        fsq_digits=state["quantizer.project_in.weight"].shape[0],
        attn_ln_eps=_scalar_const(g, "/blocks.0/attn_ln/Add", 1, 1e-5),
        mlp_ln_eps=_scalar_const(g, "/blocks.0/mlp_ln/Add", 1, 1e-5),
    )
    return cfg, state


def onnx_attr(a):
    from onnx import helper

    return helper.get_attribute_value(a)


# ---- CAM++ -------------------------------------------------------------------------------
_CAM = "CAM++"


def _module_path(node_name: str) -> str:
    """'/head/layer1/layer1.0/conv1/Conv' -> 'head.layer1.0.conv1' (a Sequential/ModuleList
    child appears in the scope with its parent's name prefixed)."""
    out: list[str] = []
    for seg in node_name.strip("/").split("/")[:-1]:
        if out and seg.startswith(out[-1] + "."):
            out[-1] = seg
        else:
            out.append(seg)
    return ".".join(out)


def _campplus_raw_state(g: OnnxGraph) -> tuple[dict, dict]:
    state, attrs = {}, {}
    for name, n in g.nodes.items():
        if not name.startswith(("/head/", "/xvector/")) or n.op_type not in ("Conv", "BatchNormalization"):
            continue
        path = _module_path(name)
        attrs[path] = {a.name: onnx_attr(a) for a in n.attribute}
        slots = ("weight", "bias") if n.op_type == "Conv" else ("weight", "bias", "running_mean", "running_var")
        for slot, inp in zip(slots, n.input[1:]):
            v = g.value(inp)
            if v is None:
                raise FrontendModelError(f"{g.path}: {name} input {inp!r} is not a constant ({_CAM})")
            state[f"{path}.{slot}"] = torch.from_numpy(np.array(v, dtype=np.float32))
    return state, attrs


def campplus_state(g: OnnxGraph) -> tuple[CAMPPlusConfig, dict]:
    """Config and state dict of a CAM++ graph (raises FrontendModelError)."""
    ins, outs = g.io_names()
    if len(ins) != 1 or len(outs) != 1:
        raise FrontendModelError(f"{g.path}: not the speaker model contract (inputs {ins}, outputs {outs})")
    for required in ("/head/conv1/Conv", "/xvector/tdnn/linear/Conv", "/xvector/dense/linear/Conv"):
        g.node(required, _CAM)
    state, attrs = _campplus_raw_state(g)
    # the last BatchNorm is affine-free: the graph carries its implied scale 1 and shift 0
    dense_bn = "xvector.dense.nonlinear.batchnorm"
    scale, shift = state.pop(f"{dense_bn}.weight", None), state.pop(f"{dense_bn}.bias", None)
    if scale is None or shift is None or not (bool((scale == 1).all()) and bool((shift == 0).all())):
        raise FrontendModelError(f"{g.path}: not the {_CAM} structure (the last BatchNorm is not affine-free)")
    blocks: dict[int, int] = {}
    for key in state:
        m = re.match(r"xvector\.block(\d+)\.tdnnd(\d+)\.", key)
        if m:
            blocks[int(m[1])] = max(blocks.get(int(m[1]), 0), int(m[2]))
    fcm = tuple(len({k.split(".")[2] for k in state if k.startswith(f"head.{layer}.")}) for layer in ("layer1", "layer2"))
    if not blocks or sorted(blocks) != list(range(1, len(blocks) + 1)):
        raise FrontendModelError(f"{g.path}: not the {_CAM} structure (no dense TDNN blocks)")
    local = state["xvector.block1.tdnnd1.cam_layer.linear_local.weight"] if (
        "xvector.block1.tdnnd1.cam_layer.linear_local.weight" in state) else None
    if local is None:
        raise FrontendModelError(f"{g.path}: not the {_CAM} structure (no CAM layer in block1)")
    feat = g.inputs[0].type.tensor_type.shape.dim
    feat_dim = feat[2].dim_value if len(feat) == 3 and feat[2].dim_value > 0 else 80
    bn_eps = [a["epsilon"] for p, a in attrs.items() if "epsilon" in a]
    seg = [n for name, n in g.nodes.items() if name.startswith("/xvector/block1/tdnnd1/cam_layer/AveragePool")]
    cfg = CAMPPlusConfig(
        feat_dim=feat_dim, m_channels=state["head.conv1.weight"].shape[0], fcm_blocks=fcm,
        init_channels=state["xvector.tdnn.linear.weight"].shape[0],
        tdnn_kernel=state["xvector.tdnn.linear.weight"].shape[2],
        growth=local.shape[0], bn_channels=local.shape[1], kernel=local.shape[2],
        cam_hidden=state["xvector.block1.tdnnd1.cam_layer.linear1.weight"].shape[0],
        block_layers=tuple(blocks[i] for i in sorted(blocks)),
        dilations=tuple(attrs[f"xvector.block{i}.tdnnd1.cam_layer.linear_local"].get("dilations", [1])[0]
                        for i in sorted(blocks)),
        seg_len=[onnx_attr(a) for a in seg[0].attribute if a.name == "kernel_shape"][0][0] if seg else 100,
        embedding=state["xvector.dense.linear.weight"].shape[0],
        bn_eps=float(bn_eps[0]) if bn_eps else 1e-5,
    )
    return cfg, state


# ---- building the modules ------------------------------------------------------------------
def _build(cls, cfg, state: dict, path: str, what: str, device=None) -> torch.nn.Module:
    """The module with exactly these tensors: built on the meta device (no random init of
    weights about to be replaced), the file's tensors assigned -- copied straight to
    ``device`` if given, else to the CPU -- the rest (rotary tables, BatchNorm counters) made
    on the CPU."""
    with torch.device("meta"):
        model = cls(cfg)
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    bad = [k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape)]
    if missing or extra or bad:
        raise FrontendModelError(f"{path}: not the {what} structure (missing {missing[:4]}, unexpected "
                                 f"{extra[:4]}, shape mismatch {sorted(bad)[:4]})")
    # One copy each, aligned and contiguous (the file's views are unaligned, and a kernel's
    # arithmetic may depend on its operands' alignment).
    if device is None:
        weights = {k: torch.empty(v.shape, dtype=v.dtype).copy_(v) for k, v in state.items()}
    else:
        weights = {k: v.to(device).contiguous() for k, v in state.items()}
    model.load_state_dict(weights, strict=False, assign=True)
    model.init_buffers()
    return model.eval()


def load_s3tokenizer(path: str | Path, device=None) -> S3TokenizerV3:
    """``device``: where its weights go, in float32 (its buffers stay on the CPU until the
    module is moved)."""
    g = OnnxGraph.read(path)
    cfg, state = s3tokenizer_state(g)
    return _build(S3TokenizerV3, cfg, state, str(path), _TOK, device)


def load_campplus(path: str | Path) -> CAMPPlus:
    g = OnnxGraph.read(path)
    cfg, state = campplus_state(g)
    return _build(CAMPPlus, cfg, state, str(path), _CAM)


__all__ = ["FrontendModelError", "OnnxGraph", "load_s3tokenizer", "load_campplus", "s3tokenizer_state", "campplus_state"]
