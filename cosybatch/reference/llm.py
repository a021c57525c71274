"""Reference speech-token generation: the official CosyVoice3LM.inference loop, one request.

Prefill the whole zero-shot input, then decode one token per step with a contiguous KV cache
(positions continue from the prefill length). Stop rule and lengths as the official code:
min_len = int(2 * n_text), max_len = int(20 * n_text) with n_text the *target* text tokens only.
During the first min_len steps the official code masks only ``sos`` (= speech_token_size), not
eos, so min_len is not really enforced (design.md D2); ``enforce_min_len=True`` masks every
stop id instead.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from cosybatch.models.config import SamplingConfig
from cosybatch.models.speech_lm import CosyVoice3LM
from cosybatch.reference.samplers import ras_sampling

# The official inference() defaults; they are not in cosyvoice3.yaml.
MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0

IdsLike = Union[torch.Tensor, Sequence[int]]


def _ids(x: IdsLike, device: torch.device) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.long)
    return t.reshape(-1).to(device=device, dtype=torch.long)


def length_limits(
    n_text: int, min_ratio: float = MIN_TOKEN_TEXT_RATIO, max_ratio: float = MAX_TOKEN_TEXT_RATIO
) -> tuple[int, int]:
    return int(n_text * min_ratio), int(n_text * max_ratio)


def mask_early_stop(logp: torch.Tensor, lm: CosyVoice3LM, enforce_min_len: bool) -> None:
    """In-place mask for a step i < min_len (logp [..., speech_vocab])."""
    if enforce_min_len:
        logp[..., lm.stop_ids.start : lm.stop_ids.stop] = -float("inf")
    else:
        logp[..., lm.cfg.sos] = -float("inf")


@torch.inference_mode()
def generate_tokens(
    lm: CosyVoice3LM,
    text_ids: IdsLike,
    prompt_text_ids: IdsLike,
    prompt_speech_tokens: IdsLike,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    enforce_min_len: bool = False,
    on_token: Callable[[int], None] | None = None,
    min_ratio: float = MIN_TOKEN_TEXT_RATIO,
    max_ratio: float = MAX_TOKEN_TEXT_RATIO,
) -> list[int]:
    """Raw speech-token ids (stop id excluded). ``on_token`` is called with each id as soon as it
    is drawn (streaming consumers). Silent-token filtering is the caller's job."""
    device = lm.speech_embedding.weight.device
    text = _ids(text_ids, device)
    prompt_text = _ids(prompt_text_ids, device)
    prompt_speech = _ids(prompt_speech_tokens, device)
    min_len, max_len = length_limits(text.numel(), min_ratio, max_ratio)
    stop = lm.stop_ids

    lm_input = lm.prompt_embeds(torch.cat([prompt_text, text]), prompt_speech).unsqueeze(0)
    n_prefill = lm_input.shape[1]
    cache = lm.backbone.new_cache()
    hidden = lm.backbone(lm_input, torch.arange(n_prefill, device=device).unsqueeze(0), cache)

    out: list[int] = []
    for i in range(max_len):
        logp = lm.logprobs(hidden[0, -1])
        if i < min_len:
            mask_early_stop(logp, lm, enforce_min_len)
        token = ras_sampling(logp, out, sampling, generator)
        if token in stop:
            break
        out.append(token)
        if on_token is not None:
            on_token(token)
        if i + 1 == max_len:
            break
        step_in = lm.speech_embedding.weight[token].view(1, 1, -1)
        pos = torch.tensor([[n_prefill + i]], device=device)
        hidden = lm.backbone(step_in, pos, cache)
    return out
