"""Random llm.pt / flow.pt / hift.pt with the official key names and shapes.

Key sets and shapes come from our own model classes (built on the meta device, so a full-size
model costs no memory), mapped back to the official names. Every tensor is drawn from its own
generator seeded by (seed, official key name), so a file does not depend on the order in which
modules register parameters, and a tensor is generated right before it is needed.

Init (as the fixture was made): matrices N(0, 1/fan_in); embeddings N(0, 1); biases
N(0, 0.05^2); norm gains / Snake alphas 1 + N(0, 0.1^2); weight-normed convs v ~ N(0, 1) with
g = |v| / sqrt(fan_in) (so the folded weight is again ~N(0, 1/fan_in)); HiFT conv_post g x0.3
(keeps exp(log-magnitude) off its clip); the F0 classifier rescaled to an F0 spread of ~80 Hz.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.config import ModelConfig

BIAS_STD = 0.05
GAIN_STD = 0.1
CONV_POST_GAIN = 0.3
F0_TARGET_STD_HZ = 80.0

LLM_PREFIX = "llm.model.model."
LLM_TIED_HEAD = "llm.model.lm_head.weight"
# hift modules whose weight is stored as a weight-norm parametrization (spec section 1)
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
    return sd


# --------------------------------------------------------------------------- flow.pt


def flow_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    from cosybatch.models.flow import CausalMaskedDiffWithDiT

    module = _build(lambda: CausalMaskedDiffWithDiT(cfg.flow))
    return {key: _draw(key, kind, shape, seed) for key, (kind, shape) in _entry_kinds(module).items()}


# --------------------------------------------------------------------------- hift.pt


def _f0_spread(sd: dict[str, torch.Tensor], n_convs: int, seed: int) -> float:
    """Std of the F0 predictor's pre-abs output on a random log-mel, with the classifier as drawn.

    Edge padding does not matter for a spread estimate, so the convs run unpadded."""
    g = _generator(seed, "f0_calibration_mel")
    in_ch = sd["f0_predictor.condnet.0" + _WN_V].shape[1]
    x = (torch.randn(1, in_ch, 200, generator=g, dtype=torch.float64) * 2.0 - 6.0)
    for i in range(n_convs):
        pre = f"f0_predictor.condnet.{2 * i}"
        gain, v = sd[pre + _WN_G].double(), sd[pre + _WN_V].double()
        w = gain * v / v.flatten(1).norm(dim=1).reshape(-1, 1, 1)
        x = F.elu(F.conv1d(x, w, sd[pre + ".bias"].double()))
    y = F.linear(x.transpose(1, 2), sd["f0_predictor.classifier.weight"].double(),
                 sd["f0_predictor.classifier.bias"].double())
    return float(y.std())


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
            if prefix == "conv_post":
                gain.mul_(CONV_POST_GAIN)
            sd[prefix + _WN_G], sd[prefix + _WN_V] = gain, v
        elif key not in sd:
            sd[key] = _draw(key, kind, shape, seed)
    n_convs = sum(1 for k in sd if k.startswith("f0_predictor.condnet.") and k.endswith(_WN_G))
    if n_convs and "f0_predictor.classifier.weight" in sd:
        spread = _f0_spread(sd, n_convs, seed)
        if spread > 0 and math.isfinite(spread):
            sd["f0_predictor.classifier.weight"].mul_(F0_TARGET_STD_HZ / spread)
            sd["f0_predictor.classifier.bias"].mul_(F0_TARGET_STD_HZ / spread)
    return sd


# --------------------------------------------------------------------------- writing

BUILDERS: dict[str, Callable[[ModelConfig, int], dict[str, torch.Tensor]]] = {
    "llm.pt": llm_state_dict,
    "flow.pt": flow_state_dict,
    "hift.pt": hift_state_dict,
}


def write_weights(out_dir: Path, cfg: ModelConfig, seed: int) -> Iterator[str]:
    """Write the three state dicts one at a time (peak memory = the largest one)."""
    for fname, build in BUILDERS.items():
        sd = build(cfg, seed)
        torch.save(sd, str(Path(out_dir) / fname))
        del sd
        yield fname
