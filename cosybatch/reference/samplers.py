"""The official CosyVoice3 token samplers (reference path).

Semantics follow ``cosyvoice.utils.common`` exactly:

* ``nucleus_sampling``: stable descending sort of softmax(scores); walk it keeping tokens while
  ``cum < top_p`` and ``count < top_k`` (so the first token, and the one that crosses top_p, are
  kept); draw one with multinomial over the kept, unnormalised probabilities. ``cum`` is a float32
  running sum compared with float32(top_p), as in the official loop over 0-d float32 tensors.
* ``ras_sampling`` (VALL-E 2 repetition-aware sampling): if the drawn id occurs at least
  ``win_size * tau_r`` times in ``decoded_tokens[-win_size:]``, its score is set to -inf and one
  token is drawn from the full softmax instead.

Randomness comes only from the ``generator`` argument (``None`` = torch's global RNG, which is
what the official code uses). Draws happen on the generator's device.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from cosybatch.models.config import SamplingConfig

def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, replacement=True, generator=generator).item())


def nucleus_count(sorted_probs: torch.Tensor, top_p: float, top_k: int) -> int:
    """How many of the descending-sorted probabilities the official nucleus walk keeps (>= 1)."""
    head = sorted_probs[: max(top_k, 1)].detach().float().cpu().numpy()
    limit = np.float32(top_p)
    cum = np.float32(0.0)
    n = 0
    while n < len(head) and n < top_k and (n == 0 or cum < limit):
        cum = np.float32(cum + head[n])
        n += 1
    return max(n, 1)


def nucleus_sampling(
    scores: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None = None
) -> int:
    probs, idx = scores.softmax(dim=0).sort(descending=True, stable=True)
    n = nucleus_count(probs, top_p, top_k)
    return int(idx[_draw(probs[:n], generator)].item())


def random_sampling(scores: torch.Tensor, generator: torch.Generator | None = None) -> int:
    return _draw(scores.softmax(dim=0), generator)


def repetition_hit(decoded_tokens: Sequence[int], token: int, win_size: int, tau_r: float) -> bool:
    """The RAS trigger. The slice is the official ``decoded_tokens[-win_size:]`` verbatim."""
    window = list(decoded_tokens)[-win_size:]
    return sum(1 for t in window if t == token) >= win_size * tau_r


def ras_sampling(
    logp: torch.Tensor,
    decoded_tokens: Sequence[int],
    cfg: SamplingConfig,
    generator: torch.Generator | None = None,
) -> int:
    """logp: 1-D scores over the speech vocabulary; decoded_tokens: ids generated so far (the
    prompt's speech tokens are not part of the window). ``logp`` is not modified."""
    token = nucleus_sampling(logp, cfg.top_p, cfg.top_k, generator)
    if repetition_hit(decoded_tokens, token, cfg.win_size, cfg.tau_r):
        scores = logp.clone()
        scores[token] = -float("inf")
        token = random_sampling(scores, generator)
    return token


