"""CosyVoice3LM: Qwen2 backbone + speech-token embedding table + speech-token head.

State-dict keys: ``backbone.*`` (llm.pt's ``llm.model.model.*``), ``speech_embedding.weight``,
``llm_decoder.weight``. Qwen's 151936-way text head is never built: CosyVoice3 only reads the
backbone's post-norm hidden states through ``llm_decoder``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.models.config import LLMConfig
from cosybatch.models.qwen2 import Qwen2Model


class CosyVoice3LM(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = Qwen2Model(cfg.qwen)
        self.speech_embedding = nn.Embedding(cfg.speech_vocab, cfg.llm_input_size)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.speech_vocab, bias=False)

    @property
    def stop_ids(self) -> range:
        """Every id that ends decoding: sos, eos, task_id, fill and the unused specials."""
        return range(self.cfg.speech_token_size, self.cfg.speech_vocab)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_tokens(ids.long())

    def embed_speech(self, ids: torch.Tensor) -> torch.Tensor:
        return self.speech_embedding(ids.long())

    def embed_mixed(self, ids: torch.Tensor, is_speech: torch.Tensor) -> torch.Tensor:
        """ids [...] with a same-shaped bool mask choosing the table (speech vs Qwen text)."""
        ids = ids.long()
        text = self.backbone.embed_tokens(torch.where(is_speech, torch.zeros_like(ids), ids))
        speech = self.speech_embedding(torch.where(is_speech, ids, torch.zeros_like(ids)))
        return torch.where(is_speech.unsqueeze(-1), speech, text)

    def prompt_embeds(self, text_ids: torch.Tensor, prompt_speech_tokens: torch.Tensor) -> torch.Tensor:
        """Zero-shot LM input [N+P+2, H]: sos | embed_tokens(text) | task_id | speech_emb(prompt).

        ``text_ids`` is prompt text followed by target text (1-D); ``prompt_speech_tokens`` 1-D."""
        w = self.speech_embedding.weight
        sos = w[self.cfg.sos].unsqueeze(0)
        task = w[self.cfg.task_id].unsqueeze(0)
        text = self.embed_text(text_ids.reshape(-1))
        speech = self.embed_speech(prompt_speech_tokens.reshape(-1))
        return torch.cat([sos, text, task, speech], dim=0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm_decoder(hidden)

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """log_softmax over the speech vocabulary, in float32 whatever the weight dtype."""
        return F.log_softmax(self.llm_decoder(hidden).float(), dim=-1)
