"""A prompt's conditioning, the one type every stage passes along (design.md, "Data flow").

The frontend makes it from a prompt WAV; the AR engine reads ``speech_tokens``; the flow reads
all three. It lives below every stage so that none of them imports another to get it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptFeatures:
    speech_tokens: torch.Tensor  # long [P], 25 Hz
    embedding: torch.Tensor  # float [1, spk_embed_dim]: the CAM++ x-vector
    mel: torch.Tensor  # float [1, token_mel_ratio * P, num_mels]: 50 Hz prompt mel

    def to(self, device) -> "PromptFeatures":
        return PromptFeatures(self.speech_tokens.to(device), self.embedding.to(device), self.mel.to(device))

    def clone(self) -> "PromptFeatures":
        return PromptFeatures(self.speech_tokens.clone(), self.embedding.clone(), self.mel.clone())
