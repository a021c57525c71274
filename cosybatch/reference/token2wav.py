"""The official token -> waveform path, one request at a time (the oracle for the codec).

Streaming recomputes the flow over prompt + all tokens so far and HiFT over the whole mel
history at every chunk, exactly as the official ``CosyVoice3Model.tts`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cosybatch.hops import Hop
from cosybatch.prompt import PromptFeatures


def flow_chunk(flow, tokens: torch.Tensor, prompt: PromptFeatures, chunk: Hop, full_attention_final: bool = True) -> torch.Tensor:
    """Mel frames [1, 80, F] that ``chunk`` adds; ``tokens`` is the segment's flow-token list [N]."""
    # The official final hop runs with streaming=False (full attention): design.md D4.
    streaming = not (chunk.finalize and full_attention_final)
    mel = flow.inference(
        token=tokens[None, : chunk.end],
        prompt_token=prompt.speech_tokens[None],
        prompt_feat=prompt.mel,
        embedding=prompt.embedding,
        streaming=streaming,
        finalize=chunk.finalize,
    )
    return mel[:, :, chunk.offset * flow.cfg.token_mel_ratio :]


def flow_full(flow, tokens: torch.Tensor, prompt: PromptFeatures) -> torch.Tensor:
    return flow.inference(
        token=tokens[None],
        prompt_token=prompt.speech_tokens[None],
        prompt_feat=prompt.mel,
        embedding=prompt.embedding,
        streaming=False,
        finalize=True,
    )


@dataclass
class HiftStream:
    """Official streaming HiFT: re-vocode the whole mel history, emit only the new samples."""

    hift: object
    mel: torch.Tensor | None = None
    emitted: int = 0
    chunks: list = field(default_factory=list)

    def push(self, new_mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        self.mel = new_mel if self.mel is None else torch.cat([self.mel, new_mel], dim=2)
        wav, _ = self.hift.inference(self.mel, finalize=finalize)
        out = wav[:, self.emitted :]
        self.emitted += out.shape[1]
        return out
