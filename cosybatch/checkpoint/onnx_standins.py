"""Stand-ins for ``speech_tokenizer_v3.onnx`` and ``campplus.onnx`` with the real I/O contract.

The official frontend addresses both models by input position/name and takes output 0, so any
graph with the same names, dtypes and shapes is a drop-in.  The stand-ins are deterministic
functions of the features (so prompts map to stable tokens/embeddings) built with the ``onnx``
helper API (opset 17, IR 8, which every onnxruntime since 1.14 reads).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OPSET = 17
IR_VERSION = 8
N_WHISPER_MELS = 128  # speech_tokenizer_v3 input channels
TOKEN_POOL = 4  # 100 Hz whisper frames -> 25 Hz tokens
FSQ_DIGITS = 8  # 3**8 = 6561 speech tokens
N_FBANK = 80  # campplus input bins
SPK_DIM = 192  # campplus embedding size
SPK_HIDDEN = 32
# Typical across-bin spread of whisper log-mel ((x+4)/4 scale) is ~0.3-0.5; this gain puts the
# projected values near unit scale so the ternary digits are roughly balanced.
_TOKEN_GAIN = 2.5


def _onnx():
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("writing the stand-in ONNX models needs the 'onnx' package") from e
    return onnx


def _model(graph, onnx):
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", OPSET)],
        producer_name="cosybatch",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def speech_tokenizer_model(rng: np.random.Generator):
    """feats f32 [B,128,T], feats_length i32 [B] -> indices i32 [B, ceil(max(feats_length)/4)]."""
    onnx = _onnx()
    h, nh = onnx.helper, onnx.numpy_helper
    w = rng.standard_normal((N_WHISPER_MELS, FSQ_DIGITS))
    # zero-mean columns: the overall loudness (a common offset on all bins) must not pick the code
    w = (w - w.mean(axis=0, keepdims=True)) * (_TOKEN_GAIN / np.sqrt(N_WHISPER_MELS))
    inits = [
        nh.from_array(w.astype(np.float32), "proj_w"),
        nh.from_array(np.zeros(FSQ_DIGITS, np.float32), "proj_b"),
        nh.from_array((3.0 ** np.arange(FSQ_DIGITS)).astype(np.float32), "pow3"),
        nh.from_array(np.ones(1, np.float32), "one"),
        nh.from_array(np.array([TOKEN_POOL - 1], np.int32), "pool_m1"),
        nh.from_array(np.array([TOKEN_POOL], np.int32), "pool"),
        nh.from_array(np.array([0], np.int64), "zero_l"),
        nh.from_array(np.array([1], np.int64), "axis1"),
        nh.from_array(np.array([-1], np.int64), "axis_last"),
    ]
    nodes = [
        h.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[TOKEN_POOL],
                    strides=[TOKEN_POOL], ceil_mode=1, count_include_pad=0),
        h.make_node("Transpose", ["pooled"], ["pooled_t"], perm=[0, 2, 1]),
        h.make_node("MatMul", ["pooled_t", "proj_w"], ["h0"]),
        h.make_node("Add", ["h0", "proj_b"], ["h1"]),
        h.make_node("Tanh", ["h1"], ["h2"]),
        h.make_node("Round", ["h2"], ["h3"]),
        h.make_node("Add", ["h3", "one"], ["digits"]),  # {-1,0,1} -> {0,1,2}
        h.make_node("Mul", ["digits", "pow3"], ["weighted"]),
        h.make_node("ReduceSum", ["weighted", "axis_last"], ["code_f"], keepdims=0),
        h.make_node("Cast", ["code_f"], ["code_i"], to=onnx.TensorProto.INT32),
        # token count = ceil(len / 4) of the longest row (the official caller passes B=1)
        h.make_node("ReduceMax", ["feats_length"], ["len_max"], keepdims=1),
        h.make_node("Add", ["len_max", "pool_m1"], ["len_p"]),
        h.make_node("Div", ["len_p", "pool"], ["tok_len_i32"]),
        h.make_node("Cast", ["tok_len_i32"], ["tok_len"], to=onnx.TensorProto.INT64),
        h.make_node("Slice", ["code_i", "zero_l", "tok_len", "axis1"], ["indices"]),
    ]
    graph = h.make_graph(
        nodes,
        "speech_tokenizer_v3_cosybatch",
        [
            h.make_tensor_value_info("feats", onnx.TensorProto.FLOAT, ["batch", N_WHISPER_MELS, "T"]),
            h.make_tensor_value_info("feats_length", onnx.TensorProto.INT32, ["batch"]),
        ],
        [h.make_tensor_value_info("indices", onnx.TensorProto.INT32, ["batch", "T_tok"])],
        inits,
    )
    return _model(graph, onnx)


def campplus_model(rng: np.random.Generator):
    """input f32 [B,T,80] -> output f32 [B,192]: mean+std pooling over time, then a ReLU MLP."""
    onnx = _onnx()
    h, nh = onnx.helper, onnx.numpy_helper
    w1 = rng.standard_normal((2 * N_FBANK, SPK_HIDDEN)) / np.sqrt(2 * N_FBANK)
    w2 = rng.standard_normal((SPK_HIDDEN, SPK_DIM)) / np.sqrt(SPK_HIDDEN)
    inits = [
        nh.from_array(w1.astype(np.float32), "w1"),
        nh.from_array((0.05 * rng.standard_normal(SPK_HIDDEN)).astype(np.float32), "b1"),
        nh.from_array(w2.astype(np.float32), "w2"),
        nh.from_array((0.05 * rng.standard_normal(SPK_DIM)).astype(np.float32), "b2"),
        nh.from_array(np.array([1e-5], np.float32), "eps"),
        nh.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        h.make_node("ReduceMean", ["input"], ["mu"], axes=[1], keepdims=1),
        h.make_node("Sub", ["input", "mu"], ["xc"]),
        h.make_node("Mul", ["xc", "xc"], ["xc2"]),
        h.make_node("ReduceMean", ["xc2"], ["var"], axes=[1], keepdims=0),
        h.make_node("Add", ["var", "eps"], ["var_e"]),
        h.make_node("Sqrt", ["var_e"], ["sd"]),
        h.make_node("Squeeze", ["mu", "axis1"], ["mu2"]),
        h.make_node("Concat", ["mu2", "sd"], ["stats"], axis=1),
        h.make_node("MatMul", ["stats", "w1"], ["z1"]),
        h.make_node("Add", ["z1", "b1"], ["z2"]),
        h.make_node("Relu", ["z2"], ["z3"]),
        h.make_node("MatMul", ["z3", "w2"], ["z4"]),
        h.make_node("Add", ["z4", "b2"], ["output"]),
    ]
    graph = h.make_graph(
        nodes,
        "campplus_cosybatch",
        [h.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", "T", N_FBANK])],
        [h.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", SPK_DIM])],
        inits,
    )
    return _model(graph, onnx)


def write_onnx_standins(out_dir: Path, seed: int) -> None:
    onnx = _onnx()
    rng = np.random.default_rng([seed, 0x0C55])
    onnx.save(speech_tokenizer_model(rng), str(Path(out_dir) / "speech_tokenizer_v3.onnx"))
    onnx.save(campplus_model(rng), str(Path(out_dir) / "campplus.onnx"))
