"""A small ONNX graph builder that names things the way torch's TorchScript exporter does.

The official frontend files were exported with that exporter, which names every node after the
module scope it came from plus its op type, numbering repeats within a scope:
``/blocks.0/attn_ln/Add`` then ``/blocks.0/attn_ln/Add_1``; a Sequential child appears with its
parent's name prefixed (``/mlp/mlp.0/MatMul``); outputs are ``<node>_output_<i>``; parameters
keep their state-dict names unless the exporter transformed them (a transposed Linear weight
becomes ``onnx::MatMul_<n>``, a conv with a folded BatchNorm ``onnx::Conv_<n>``); constants are
``Constant`` nodes. Loaders written for the official files key on these node names and on input
positions, so the stand-ins are built with the same conventions.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

OPSET = 16  # the official speech_tokenizer_v3.onnx is opset 16 (LayerNorm exported decomposed)
IR_VERSION = 8


def onnx_module():
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("writing the stand-in ONNX models needs the 'onnx' package") from e
    return onnx


class GraphBuilder:
    def __init__(self, name: str, first_opaque_id: int = 1000):
        self.onnx = onnx_module()
        self.name = name
        self.nodes: list = []
        self.initializers: list = []
        self._counts: Counter = Counter()
        self._opaque = first_opaque_id
        self._init_names: set[str] = set()

    # ---- naming -----------------------------------------------------------------------
    def _node_name(self, scope: str, op: str) -> str:
        base = f"{scope}/{op}"
        k = self._counts[base]
        self._counts[base] += 1
        return base if k == 0 else f"{base}_{k}"

    def op(self, op_type: str, inputs: Sequence[str], scope: str = "", n_out: int = 1,
           out_names: Sequence[str] | None = None, **attrs):
        """Add a node in module scope ``scope`` ("" = the root, else like "/blocks.0/attn");
        returns its output name (or a list when n_out > 1)."""
        name = self._node_name(scope, op_type)
        outs = list(out_names) if out_names else [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def const(self, value, scope: str = "", dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        tensor = self.onnx.numpy_helper.from_array(arr)
        return self.op("Constant", [], scope, value=tensor)

    def param(self, array: np.ndarray, name: str | None = None, opaque_op: str | None = None) -> str:
        """An initializer under its state-dict ``name``, or an exporter-style ``onnx::<op>_<n>``."""
        if name is None:
            name = f"onnx::{opaque_op}_{self._opaque}"
            self._opaque += 1
        if name in self._init_names:
            raise ValueError(f"duplicate initializer {name}")
        self._init_names.add(name)
        arr = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
        self.initializers.append(self.onnx.numpy_helper.from_array(arr, name))
        return name

    # ---- common patterns ------------------------------------------------------------------
    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray | None, scope: str, bias_name: str | None):
        """torch Linear as exported: MatMul with the transposed weight, then Add(bias, y)."""
        y = self.op("MatMul", [x, self.param(np.asarray(weight).T, opaque_op="MatMul")], scope)
        if bias is None:
            return y
        return self.op("Add", [self.param(bias, bias_name), y], scope)

    def layer_norm(self, x: str, weight, bias, eps: float, scope: str, prefix: str) -> str:
        """LayerNorm over the last axis as opset < 17 exports it: ReduceMean, Sub, Pow,
        ReduceMean_1, Add (eps), Sqrt, Div, Mul (weight), Add_1 (bias)."""
        mean = self.op("ReduceMean", [x], scope, axes=[-1])
        xc = self.op("Sub", [x, mean], scope)
        sq = self.op("Pow", [xc, self.const(np.float32(2.0), scope)], scope)
        var = self.op("ReduceMean", [sq], scope, axes=[-1])
        std = self.op("Sqrt", [self.op("Add", [var, self.const(np.float32(eps), scope)], scope)], scope)
        y = self.op("Mul", [self.op("Div", [xc, std], scope), self.param(weight, f"{prefix}.weight")], scope)
        return self.op("Add", [y, self.param(bias, f"{prefix}.bias")], scope)

    def gelu(self, x: str, scope: str) -> str:
        """Exact (erf) GELU as exported: x * (erf(x / sqrt 2) + 1) * 0.5."""
        e = self.op("Erf", [self.op("Div", [x, self.const(np.float32(1.4142135381698608), scope)], scope)], scope)
        y = self.op("Mul", [x, self.op("Add", [e, self.const(np.float32(1.0), scope)], scope)], scope)
        return self.op("Mul", [y, self.const(np.float32(0.5), scope)], scope)

    def dim(self, x: str, axis: int, scope: str) -> str:
        """A 1-element int64 tensor holding x.shape[axis]."""
        shape = self.op("Shape", [x], scope)
        d = self.op("Gather", [shape, self.const(np.int64(axis), scope)], scope, axis=0)
        return self.op("Unsqueeze", [d, self.const(np.array([0], np.int64), scope)], scope)

    # ---- output -------------------------------------------------------------------------
    def model(self, inputs: list, outputs: list, check: bool = True):
        onnx = self.onnx
        graph = onnx.helper.make_graph(self.nodes, self.name, inputs, outputs, self.initializers)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)],
                                       producer_name="cosybatch")
        model.ir_version = IR_VERSION
        if check:
            onnx.checker.check_model(model)
        return model


def save_atomic(model, path) -> None:
    """Write next to ``path`` and rename, so an interrupted write never leaves a torn model."""
    from cosybatch.atomic import replaced_on_success

    with replaced_on_success(path) as tmp:
        tmp.write_bytes(model.SerializeToString())


__all__ = ["GraphBuilder", "OPSET", "IR_VERSION", "save_atomic", "onnx_module"]
