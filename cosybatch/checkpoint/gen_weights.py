"""Random llm.pt / flow.pt / hift.pt with the official key names and shapes.

Key sets and shapes come from our own model classes (built on the meta device, so a full-size
model costs no memory), mapped back to the official names. Every tensor is drawn from its own
generator seeded by (seed, official key name), so a file does not depend on the order in which
modules register parameters, and a tensor is generated right before it is needed.

Init (the fixture's recipe, plus calibrations): matrices N(0, 1/fan_in); embeddings N(0, 1); biases
N(0, 0.05^2); norm gains / Snake alphas 1 + N(0, 0.1^2); weight-normed convs v ~ N(0, 1) with
g = |v| / sqrt(fan_in) (so the folded weight is again ~N(0, 1/fan_in)); HiFT conv_post g rescaled
(calibrated on a random mel so exp(log-magnitude) stays off its clip); the F0 classifier
rescaled to an F0 spread of ~80 Hz; the LLM head's stop rows are reshaped (see EOS_ROW_GAIN).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from cosybatch.models.config import ModelConfig

BIAS_STD = 0.05
GAIN_STD = 0.1
F0_TARGET_STD_HZ = 80.0
# conv_post's log-magnitude rows feed exp(); this spread keeps the waveform unclipped (the
# fixture's HiFT has ~0.5-0.6); a fixed x0.3 gain was not enough for every size and seed
LOG_MAG_TARGET_STD = 0.6
CALIBRATION_MEL_STD = 1.5  # random flows emit mels around N(0, 1.2-1.8)
CALIBRATION_FRAMES = 40
# Random Gaussian rows make each of the 200 stop ids (sos .. speech_vocab-1) about as likely as
# a speech token, i.e. a stop every ~30 steps under the official RAS sampling.  Only eos is kept
# live, with a wider row: measured with official sampling (24 runs, seed 0) the mean length is
# ~106 tokens at `full` and ~65 at `small` (geometric-like, text-independent).
EOS_ROW_GAIN = 2.5
OTHER_STOP_ROW_GAIN = 0.1

LLM_PREFIX = "llm.model.model."
LLM_TIED_HEAD = "llm.model.lm_head.weight"
# hift modules whose weight is stored as a weight-norm parametrization (design.md, "Checkpoint")
_HIFT_WN = re.compile(
    r"^(conv_pre|conv_post|ups\.\d+|(source_)?resblocks\.\d+\.convs[12]\.\d+|f0_predictor\.condnet\.\d+)$"
)
_WN_G = ".parametrizations.weight.original0"
_WN_V = ".parametrizations.weight.original1"

# kinds of parameters, each with its own init rule
EMBEDDING, MATRIX, BIAS, GAIN, BUFFER = "embedding", "matrix", "bias", "gain", "buffer"


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _fan_in(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else shape[0]


def _build(factory: Callable[[], nn.Module]) -> nn.Module:
    """The module on the meta device (shapes only); falls back to CPU for constructors that
    insist on real tensors (e.g. a noise table drawn from a CPU generator)."""
    try:
        with torch.device("meta"):
            return factory()
    except Exception:  # noqa: BLE001 - any failure on meta just means: build it for real
        return factory()


def _entry_kinds(module: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Module state-dict key -> (init kind, shape), in state-dict order (buffers included)."""
    kinds: dict[str, str] = {}
    for mod_name, mod in module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(mod, nn.Embedding):
                kind = EMBEDDING
            elif pname == "bias":
                kind = BIAS
            elif p.dim() >= 2:
                kind = MATRIX
            else:
                kind = GAIN
            kinds[f"{mod_name}.{pname}" if mod_name else pname] = kind
    return {k: (kinds.get(k, BUFFER), tuple(t.shape)) for k, t in module.state_dict(keep_vars=True).items()}


def _draw(key: str, kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if kind == BUFFER:
        return _buffer(key, shape)
    g = _generator(seed, key)
    if kind == EMBEDDING:
        return torch.randn(shape, generator=g)
    if kind == MATRIX:
        return torch.randn(shape, generator=g).mul_(1.0 / math.sqrt(_fan_in(shape)))
    if kind == BIAS:
        return torch.randn(shape, generator=g).mul_(BIAS_STD)
    if kind == GAIN:
        return torch.randn(shape, generator=g).mul_(GAIN_STD).add_(1.0)
    raise ValueError(kind)


def _weight_norm_pair(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.randn(shape, generator=g)
    norm = v.flatten(1).norm(dim=1).reshape((shape[0],) + (1,) * (len(shape) - 1))
    return norm / math.sqrt(_fan_in(shape)), v


def _rotary_inv_freq(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    # x-transformers RotaryEmbedding(dim_head): 1 / 10000^(arange(0, dim_head, 2) / dim_head)
    dim = 2 * shape[0]
    return 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))


_KNOWN_BUFFERS = {"inv_freq": _rotary_inv_freq}


def _buffer(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    fn = _KNOWN_BUFFERS.get(key.rsplit(".", 1)[-1])
    if fn is None:
        raise ValueError(f"no rule to generate persistent buffer {key!r} {shape}")
    return fn(key, shape)


# --------------------------------------------------------------------------- llm.pt


def llm_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    from cosybatch.models.speech_lm import CosyVoice3LM

    module = _build(lambda: CosyVoice3LM(cfg.llm))
    entries = _entry_kinds(module)
    extra = [k for k, (kind, _) in entries.items() if kind == BUFFER]
    if extra:
        raise ValueError(f"llm.pt has no buffers, but the model registers {extra}")
    sd: dict[str, torch.Tensor] = {}
    for key, (kind, shape) in entries.items():
        if key.startswith("backbone."):
            name = LLM_PREFIX + key[len("backbone."):]
        else:
            if LLM_TIED_HEAD not in sd:
                # the official file carries Qwen's tied lm_head as a duplicate right after the
                # backbone; sharing the storage keeps it free on disk and in memory
                sd[LLM_TIED_HEAD] = sd[LLM_PREFIX + "embed_tokens.weight"]
            name = key
        sd[name] = _draw(name, kind, shape, seed)
    sd.setdefault(LLM_TIED_HEAD, sd[LLM_PREFIX + "embed_tokens.weight"])
    head = sd["llm_decoder.weight"]
    sos, eos = cfg.llm.sos, cfg.llm.eos
    head[sos:].mul_(OTHER_STOP_ROW_GAIN)
    head[eos].mul_(EOS_ROW_GAIN / OTHER_STOP_ROW_GAIN)
    return sd


# --------------------------------------------------------------------------- flow.pt


def flow_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    from cosybatch.models.flow import CausalMaskedDiffWithDiT

    module = _build(lambda: CausalMaskedDiffWithDiT(cfg.flow))
    return {key: _draw(key, kind, shape, seed) for key, (kind, shape) in _entry_kinds(module).items()}


# --------------------------------------------------------------------------- hift.pt


def hift_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    from cosybatch.models.hift import CausalHiFTGenerator

    module = _build(lambda: CausalHiFTGenerator(cfg.hift))
    kinds = _entry_kinds(module)
    sd: dict[str, torch.Tensor] = {}
    for key, (kind, shape) in kinds.items():
        prefix, pname = key.rsplit(".", 1)
        if pname == "weight" and _HIFT_WN.match(prefix):
            # the official file lists bias before the parametrization (registration order)
            bias_key = prefix + ".bias"
            if bias_key in kinds and bias_key not in sd:
                sd[bias_key] = _draw(bias_key, BIAS, kinds[bias_key][1], seed)
            gain, v = _weight_norm_pair(shape, _generator(seed, prefix + ".parametrizations.weight"))
            sd[prefix + _WN_G], sd[prefix + _WN_V] = gain, v
        elif key not in sd:
            sd[key] = _draw(key, kind, shape, seed)
    _calibrate_hift(sd, cfg, seed)
    return sd


def _fold(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in sd.items():
        if k.endswith(_WN_V):
            continue
        if k.endswith(_WN_G):
            prefix = k[: -len(_WN_G)]
            v = sd[prefix + _WN_V]
            out[prefix + ".weight"] = t * v / v.flatten(1).norm(dim=1).reshape((-1,) + (1,) * (v.dim() - 1))
        else:
            out[k] = t
    return out


def _output_spread(module: nn.Module, hooked: nn.Module, mel: torch.Tensor, rows: slice) -> float:
    """Std over ``rows`` of what ``hooked`` returns during one ``module.inference(mel)``, minus its bias."""
    seen: list[torch.Tensor] = []
    handle = hooked.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().double()))
    try:
        module.inference(mel, finalize=True)
    finally:
        handle.remove()
    out = seen[-1].movedim(-1 if isinstance(hooked, nn.Linear) else 1, 0)[rows]
    bias = hooked.bias.detach().double()[rows].reshape((-1,) + (1,) * (out.dim() - 1))
    spread = float((out - bias).std())
    if not math.isfinite(spread) or spread <= 0:
        raise ValueError(f"HiFT calibration: degenerate output spread {spread}")
    return spread


def _calibrate_hift(sd: dict[str, torch.Tensor], cfg: ModelConfig, seed: int) -> None:
    """Rescale the F0 classifier (F0 spread ~F0_TARGET_STD_HZ) and conv_post's g (log-magnitude
    spread LOG_MAG_TARGET_STD) on a random flow-like mel.

    Runs our own CausalHiFTGenerator (CPU, a short mel) and reads the two layers through
    hooks, so it relies only on the module names the official layout fixes."""
    from cosybatch.models.hift import CausalHiFTGenerator

    hcfg = cfg.hift
    module = CausalHiFTGenerator(hcfg)
    module.load_state_dict(_fold(sd), strict=True)
    module.eval()
    g = _generator(seed, "hift_calibration_mel")
    mel = torch.randn(1, hcfg.in_channels, CALIBRATION_FRAMES, generator=g) * CALIBRATION_MEL_STD
    clf = module.f0_predictor.classifier
    scale = F0_TARGET_STD_HZ / _output_spread(module, clf, mel, slice(None))
    for name in ("weight", "bias"):
        sd[f"f0_predictor.classifier.{name}"].mul_(scale)
        getattr(clf, name).data.mul_(scale)
    n_mag = hcfg.n_fft // 2 + 1
    spread = _output_spread(module, module.conv_post, mel, slice(0, n_mag))
    sd["conv_post" + _WN_G].mul_(LOG_MAG_TARGET_STD / spread)


# --------------------------------------------------------------------------- writing

# llm.pt last: tools treat its presence as "this directory holds a checkpoint"
BUILDERS: dict[str, Callable[[ModelConfig, int], dict[str, torch.Tensor]]] = {
    "flow.pt": flow_state_dict,
    "hift.pt": hift_state_dict,
    "llm.pt": llm_state_dict,
}


def write_weights(out_dir: Path, cfg: ModelConfig, seed: int) -> Iterator[str]:
    """Write the three state dicts one at a time (peak memory = the largest one), each through a
    temporary name so an interrupted run never leaves a truncated file under the real name."""
    for fname, build in BUILDERS.items():
        sd = build(cfg, seed)
        final = Path(out_dir) / fname
        tmp = final.with_name(final.name + ".partial")
        torch.save(sd, str(tmp))
        del sd
        os.replace(tmp, final)
        yield fname
