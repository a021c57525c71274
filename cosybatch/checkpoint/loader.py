"""Typed config from a checkpoint directory, and strict loading of llm.pt / flow.pt / hift.pt.

Loading is strict on purpose: a silently half-loaded model still produces audio (noise), so
every missing, unexpected or mis-shaped tensor is an error that names the file.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from cosybatch.models.config import (
    DiTConfig,
    FlowConfig,
    HiFTConfig,
    LLMConfig,
    MelConfig,
    ModelConfig,
    QwenConfig,
    SamplingConfig,
)
from cosybatch.checkpoint.hyperyaml import HyperYamlError, YamlObject, load_hyperyaml
from cosybatch.checkpoint.resolve import YAML_NAME, CheckpointError

BLANK_EN = "CosyVoice-BlankEN"
# Classes CosyVoice3 accepts (the official get_model_type asserts the same triple).
_EXPECTED = {"llm": "CosyVoice3LM", "flow": "CausalMaskedDiffWithDiT", "hift": "CausalHiFTGenerator"}
# Derived constants some exporters leave out; the module's own value is then kept.
_OPTIONAL_BUFFERS = {"decoder.estimator.rotary_embed.inv_freq"}
_PARAMETRIZED = re.compile(r"^(?:(.*)\.)?parametrizations\.([^.]+)\.original([01])$")


# ---------------------------------------------------------------- config ------------------


def _need(obj: Any, key: str, where: str) -> Any:
    src = obj.kwargs if isinstance(obj, YamlObject) else obj
    if not isinstance(src, Mapping) or key not in src:
        raise CheckpointError(f"{YAML_NAME}: missing `{where}.{key}`")
    return src[key]


def _opt(obj: Any, key: str, default: Any) -> Any:
    src = obj.kwargs if isinstance(obj, YamlObject) else obj
    return src.get(key, default) if isinstance(src, Mapping) else default


def _default(cls, name: str) -> Any:
    for f in fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)


def _tuple(x: Any) -> tuple:
    return tuple(_tuple(v) if isinstance(v, (list, tuple)) else v for v in x)


def _object(conf: Mapping, key: str) -> YamlObject:
    obj = conf.get(key)
    if not isinstance(obj, YamlObject):
        raise CheckpointError(f"{YAML_NAME}: `{key}` must be a !new: object")
    want = _EXPECTED[key]
    if obj.class_name != want:
        raise CheckpointError(
            f"{YAML_NAME}: `{key}` is {obj.target}, expected {want} (is this a CosyVoice3 checkpoint?)"
        )
    return obj


def _qwen_config(qwen: Mapping) -> QwenConfig:
    for key in ("rope_scaling", "sliding_window_pattern"):
        if qwen.get(key):
            raise CheckpointError(f"{BLANK_EN}/config.json: `{key}` is not supported: {qwen[key]!r}")
    if qwen.get("use_sliding_window"):
        raise CheckpointError(f"{BLANK_EN}/config.json: use_sliding_window=true is not supported")
    try:
        heads = int(qwen["num_attention_heads"])
        return QwenConfig(
            hidden_size=int(qwen["hidden_size"]),
            num_hidden_layers=int(qwen["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(qwen.get("num_key_value_heads", heads)),
            intermediate_size=int(qwen["intermediate_size"]),
            rms_norm_eps=float(qwen.get("rms_norm_eps", _default(QwenConfig, "rms_norm_eps"))),
            rope_theta=float(qwen.get("rope_theta", 10000.0)),
            vocab_size=int(qwen["vocab_size"]),
            max_position_embeddings=int(qwen.get("max_position_embeddings", 32768)),
        )
    except KeyError as e:
        raise CheckpointError(f"{BLANK_EN}/config.json: missing `{e.args[0]}`") from None


def _llm_config(conf: Mapping, qwen: QwenConfig) -> LLMConfig:
    llm = _object(conf, "llm")
    samp = _opt(llm, "sampling", None)
    s = {f.name: type(f.default)(_opt(samp, f.name, f.default)) for f in fields(SamplingConfig)}
    cfg = LLMConfig(
        qwen=qwen,
        llm_input_size=int(_need(llm, "llm_input_size", "llm")),
        llm_output_size=int(_need(llm, "llm_output_size", "llm")),
        speech_token_size=int(_need(llm, "speech_token_size", "llm")),
        sampling=SamplingConfig(**s),
    )
    if not cfg.llm_input_size == cfg.llm_output_size == qwen.hidden_size:
        raise CheckpointError(
            f"llm_input_size {cfg.llm_input_size} / llm_output_size {cfg.llm_output_size} in {YAML_NAME} "
            f"disagree with hidden_size {qwen.hidden_size} in {BLANK_EN}/config.json"
        )
    return cfg


def _flow_config(conf: Mapping) -> FlowConfig:
    flow = _object(conf, "flow")
    pre = _need(flow, "pre_lookahead_layer", "flow")
    dec = _need(flow, "decoder", "flow")
    est = _need(dec, "estimator", "flow.decoder")
    cfm = _opt(dec, "cfm_params", {})
    cfm = _opt(cfm, "content", cfm)  # !new:omegaconf.DictConfig {content: {...}}
    mel_dim = int(_opt(est, "mel_dim", 80))  # defaults below are the official DiT signature's
    dit = DiTConfig(
        dim=int(_need(est, "dim", "flow.decoder.estimator")),
        depth=int(_need(est, "depth", "flow.decoder.estimator")),
        heads=int(_opt(est, "heads", 8)),
        dim_head=int(_opt(est, "dim_head", 64)),
        ff_mult=int(_opt(est, "ff_mult", 4)),
        mel_dim=mel_dim,
        mu_dim=int(_opt(est, "mu_dim", None) or mel_dim),
        spk_dim=int(_need(est, "spk_dim", "flow.decoder.estimator")),
        out_channels=int(_opt(est, "out_channels", None) or mel_dim),
        static_chunk_size=int(_opt(est, "static_chunk_size", 50)),
    )
    pre_len = int(_need(flow, "pre_lookahead_len", "flow"))
    if int(_opt(pre, "pre_lookahead_len", pre_len)) != pre_len:
        raise CheckpointError(f"{YAML_NAME}: flow.pre_lookahead_len disagrees with flow.pre_lookahead_layer")
    return FlowConfig(
        input_size=int(_need(flow, "input_size", "flow")),
        output_size=int(_need(flow, "output_size", "flow")),
        spk_embed_dim=int(_need(flow, "spk_embed_dim", "flow")),
        vocab_size=int(_need(flow, "vocab_size", "flow")),
        token_mel_ratio=int(_need(flow, "token_mel_ratio", "flow")),
        pre_lookahead_len=pre_len,
        pre_lookahead_channels=int(_need(pre, "channels", "flow.pre_lookahead_layer")),
        dit=dit,
        sigma_min=float(_opt(cfm, "sigma_min", _default(FlowConfig, "sigma_min"))),
        inference_cfg_rate=float(_opt(cfm, "inference_cfg_rate", _default(FlowConfig, "inference_cfg_rate"))),
    )


def _hift_config(conf: Mapping) -> HiFTConfig:
    hift = _object(conf, "hift")
    istft = _opt(hift, "istft_params", {})
    f0 = _opt(hift, "f0_predictor", None)
    kw: dict[str, Any] = {}
    for name in (
        "in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma",
        "nsf_voiced_threshold", "upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes",
        "resblock_dilation_sizes", "source_resblock_kernel_sizes", "source_resblock_dilation_sizes",
        "lrelu_slope", "audio_limit", "conv_pre_look_right",
    ):  # fmt: skip
        if name in hift:
            kw[name] = hift[name]
    for name in ("n_fft", "hop_len"):
        if name in istft:
            kw[name] = istft[name]
    if f0 is not None:
        for src, dst in (("num_class", "f0_num_class"), ("in_channels", "f0_in_channels"),
                         ("cond_channels", "f0_cond_channels")):  # fmt: skip
            if src in f0:
                kw[dst] = f0[src]
    out = {}
    for name, value in kw.items():
        d = _default(HiFTConfig, name)
        out[name] = _tuple(value) if isinstance(d, tuple) else type(d)(value)
    return HiFTConfig(**out)


def _mel_config(conf: Mapping) -> MelConfig:
    fe = conf.get("feat_extractor")
    if not isinstance(fe, YamlObject):
        raise CheckpointError(f"{YAML_NAME}: `feat_extractor` must be a !name: object")
    out: dict[str, Any] = {}
    for f in fields(MelConfig):
        if f.name not in fe:
            continue
        value = fe[f.name]
        if f.name == "center":
            out[f.name] = bool(value)
        elif f.name == "fmax":
            out[f.name] = None if value is None else float(value)
        else:
            out[f.name] = type(f.default)(value)
    return MelConfig(**out)


def config_from_yaml(conf: Mapping, qwen_json: Mapping) -> ModelConfig:
    """ModelConfig from a parsed cosyvoice3.yaml (see hyperyaml) and BlankEN's config.json."""
    qwen = _qwen_config(qwen_json)
    return ModelConfig(
        llm=_llm_config(conf, qwen),
        flow=_flow_config(conf),
        hift=_hift_config(conf),
        mel=_mel_config(conf),
        sample_rate=int(_need(conf, "sample_rate", "<top level>")),
        token_frame_rate=int(_need(conf, "token_frame_rate", "<top level>")),
        chunk_size=int(_need(conf, "chunk_size", "<top level>")),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    yaml_path, qwen_path = model_dir / YAML_NAME, model_dir / BLANK_EN / "config.json"
    for p in (yaml_path, qwen_path):
        if not p.is_file():
            raise CheckpointError(f"{p}: file not found (incomplete checkpoint directory?)")
    try:
        conf = load_hyperyaml(yaml_path, overrides={"qwen_pretrain_path": str(model_dir / BLANK_EN)})
    except HyperYamlError as e:
        raise CheckpointError(str(e)) from e
    try:
        qwen = json.loads(qwen_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{qwen_path}: unreadable: {e}") from e
    try:
        return config_from_yaml(conf, qwen)
    except CheckpointError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{yaml_path}: unexpected value: {e}") from e


# ---------------------------------------------------------------- state dicts -------------


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        try:  # mmap keeps the 2 GB llm.pt from being held twice while it is copied in
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, TypeError):
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any unpickling failure means a bad file
        raise CheckpointError(f"{path}: cannot be read as a state dict: {e}") from e
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{path}: expected a state dict, got {type(sd).__name__}")
    # Training checkpoints carry bookkeeping scalars next to the weights.
    return {k: v for k, v in sd.items() if not (k in ("epoch", "step") and not torch.is_tensor(v))}


def llm_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llm.pt -> CosyVoice3LM keys: the HF wrapper prefix becomes ``backbone.``; the tied
    text head is dropped (the speech LM never computes text logits)."""
    out = {}
    for k, v in sd.items():
        if k == "llm.model.lm_head.weight":
            continue
        if k.startswith("llm.model.model."):
            k = "backbone." + k[len("llm.model.model."):]
        out[k] = v
    return out


def flow_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(sd)


def _norm_dim(g: torch.Tensor, v: torch.Tensor) -> int:
    """The ``dim`` weight_norm was applied with, read off g's shape (-1 = whole tensor)."""
    if g.dim() == 0 or g.numel() == 1 and v.shape[0] != 1:
        return -1
    big = [d for d in range(g.dim()) if g.shape[d] != 1]
    return big[0] if big else 0


def _fold(g: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None:
        g, v = g.to(dtype), v.to(dtype)
    dim = _norm_dim(g, v)
    if hasattr(torch, "_weight_norm"):  # the kernel weight_norm itself runs: bit-identical
        return torch._weight_norm(v, g, dim)
    dims = [d for d in range(v.dim()) if d != dim] if dim >= 0 else list(range(v.dim()))
    return v * (g / v.norm(2, dim=dims, keepdim=True))


def fold_weight_norm(sd: Mapping[str, torch.Tensor], float64_prefixes: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Replace weight-norm pairs by the plain weight w = g * v / ||v|| (norm over all dims but
    the one g spans). Both layouts are accepted: ``X.parametrizations.W.original0/1`` and
    ``X.W_g`` / ``X.W_v``. Pairs under ``float64_prefixes`` are folded (and kept) in float64,
    because the official code casts those modules to float64 *before* it recomputes w.
    Unpaired halves are passed through so that strict loading reports them."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for k, t in sd.items():
        base = None
        m = _PARAMETRIZED.match(k)
        if m:
            head, name, which = m.groups()
            base, part = (f"{head}.{name}" if head else name), "g" if which == "0" else "v"
        elif k.endswith(("_g", "_v")):
            base, part = k[:-2], k[-1]
        if base is None:
            out[k] = t
        else:
            pairs.setdefault(base, {})[part] = (k, t)
    for base, p in pairs.items():
        if "g" in p and "v" in p:
            f64 = any(base.startswith(pre) for pre in float64_prefixes)
            out[base] = _fold(p["g"][1], p["v"][1], torch.float64 if f64 else None)
        else:  # not a pair: pass through untouched
            out.update(dict(p.values()))
    return out


def hift_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hift.pt -> CausalHiFTGenerator keys: drop the HiFiGan wrapper's ``generator.`` (the
    official loader replaces every occurrence) and fold weight norm."""
    plain = {k.replace("generator.", ""): v for k, v in sd.items()}
    return fold_weight_norm(plain, float64_prefixes=("f0_predictor.",))


def strict_load(module: nn.Module, state_dict: Mapping[str, torch.Tensor], what: str,
                device: str | torch.device | None = None) -> None:
    """load_state_dict(strict=True), but failing with one CheckpointError that names ``what``
    and lists every missing key, unexpected key and shape mismatch. ``device``: each tensor
    goes from the file straight there, in the dtype of the module's own tensor (what copying
    into it would convert to), and replaces it: no copy into the CPU module first (3.4 GB of
    fresh pages for the full-size LM and flow), then none out of it, tensor by tensor."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state_dict and k not in _OPTIONAL_BUFFERS]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [
        f"{k}: file {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mismatched:
        lines = [f"{what}: does not match {type(module).__name__}"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                             ("shape mismatches", mismatched)):  # fmt: skip
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines.extend(f"    {i}" for i in items)
        raise CheckpointError("\n".join(lines))
    sd = dict(state_dict)
    for k in _OPTIONAL_BUFFERS:
        if k in expected and k not in sd:
            sd[k] = expected[k]
    if device is not None:
        sd = {k: v.to(device=device, dtype=expected[k].dtype).contiguous() for k, v in sd.items()}
    try:
        module.load_state_dict(sd, strict=True, assign=device is not None)
    except RuntimeError as e:
        raise CheckpointError(f"{what}: {e}") from e


# ---------------------------------------------------------------- models ------------------


_RANDOM_INITS = ("kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "uniform_",
                 "normal_", "trunc_normal_")


@contextlib.contextmanager
def _no_random_init():
    """Build modules without the random fill of their parameters: ``strict_load`` replaces
    every parameter right after, and the fills cost more than reading the files (the full-size
    models load in 5.0 s without them and 13.6 s with them on 2 CPU cores). Nothing depends on
    these draws: the fixed noise tables replay the official ones on private generators
    (``models/noise.py``)."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in _RANDOM_INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


@dataclass
class LoadedModels:
    cfg: ModelConfig
    llm: nn.Module  # cosybatch.models.speech_lm.CosyVoice3LM
    flow: nn.Module  # cosybatch.models.flow.CausalMaskedDiffWithDiT
    hift: nn.Module  # cosybatch.models.hift.CausalHiFTGenerator


def load_models(model_dir: str | Path, device: str | torch.device = "cpu") -> LoadedModels:
    """Config + the three networks with their checkpoints strictly loaded, in eval mode."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    files = {name: model_dir / f"{name}.pt" for name in ("llm", "flow", "hift")}
    for path in files.values():  # fail before spending time building modules
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (incomplete checkpoint directory?)")

    from cosybatch.models.flow import CausalMaskedDiffWithDiT
    from cosybatch.models.hift import CausalHiFTGenerator
    from cosybatch.models.speech_lm import CosyVoice3LM

    built = {}
    for name, cls, sub, convert in (
        ("llm", CosyVoice3LM, cfg.llm, llm_state_dict),
        ("flow", CausalMaskedDiffWithDiT, cfg.flow, flow_state_dict),
        ("hift", CausalHiFTGenerator, cfg.hift, hift_state_dict),
    ):
        # HiFT replays the construction-time RNG, whose draws depend on the flow's shapes too.
        with _no_random_init():
            module = cls(sub, model_cfg=cfg) if name == "hift" else cls(sub)
        sd = convert(read_state_dict(files[name]))
        # On a GPU the weights go there from the file; then only the buffers the module made
        # itself (noise and source tables, the STFT window) move with .to().
        strict_load(module, sd, str(files[name]), device=None if torch.device(device).type == "cpu" else device)
        del sd
        built[name] = module.to(device).eval()
    return LoadedModels(cfg=cfg, **built)
