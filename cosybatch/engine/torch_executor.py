"""Per-sequence eager forward through the model's own layer pieces, over the paged cache.

This is the parity path (CPU, float32): each sequence is run on its own with exactly the shapes
the reference loop uses (whole prompt at prefill, one token per decode step), so its tokens
cannot depend on the other sequences in flight, and its arithmetic is the reference's. Only the
K/V storage differs: K/V go into the engine's paged blocks and are gathered back per step.
"""

from __future__ import annotations

import torch

from cosybatch.engine.kv_cache import PagedKVCache
from cosybatch.engine.request import Sequence
from cosybatch.models.qwen2 import causal_mask_with_past
from cosybatch.models.speech_lm import CosyVoice3LM


class TorchExecutor:
    name = "torch"
    graphable = False

    def __init__(self, lm: CosyVoice3LM, cache: PagedKVCache, vocab_padded: int):
        self.lm = lm
        self.bb = lm.backbone
        self.cache = cache
        self.vocab = lm.cfg.speech_vocab
        self.vocab_padded = vocab_padded
        self.device = lm.speech_embedding.weight.device

    def _forward(self, seq: Sequence, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [1, T, H] new inputs at positions start.. -> post-norm hidden of the last one [H]."""
        t = x.shape[1]
        bs = self.cache.block_size
        dev = self.device
        pos = torch.arange(start, start + t, device=dev).unsqueeze(0)
        cos, sin = self.bb.rope(pos, x.dtype)
        new_slots = torch.tensor(PagedKVCache.slots_for(seq.blocks, start, start + t, bs), device=dev)
        ctx_slots = None
        mask = None
        if start > 0:
            ctx_slots = torch.tensor(PagedKVCache.slots_for(seq.blocks, 0, start + t, bs), device=dev)
            mask = causal_mask_with_past(start, t, dev)
        for i, layer in enumerate(self.bb.layers):
            q, k, v = layer.attn_inputs(x, cos, sin)
            kf, vf = self.cache.flat_slots(i)
            kf[new_slots] = k[0].to(kf.dtype)
            vf[new_slots] = v[0].to(vf.dtype)
            if ctx_slots is None:
                # a fresh prompt attends to itself only: use the new K/V directly, in the same
                # layout the reference hands to SDPA
                kk, vv = k.transpose(1, 2), v.transpose(1, 2)
            else:
                kk = kf[ctx_slots].transpose(0, 1).unsqueeze(0).to(x.dtype).contiguous()
                vv = vf[ctx_slots].transpose(0, 1).unsqueeze(0).to(x.dtype).contiguous()
            x = layer.attn_output_and_mlp(x, layer.self_attn.sdpa(q.transpose(1, 2), kk, vv, mask))
        return self.bb.norm(x)[0, -1]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.vocab_padded,), float("-inf"), dtype=torch.float32, device=self.device)
        out[: self.vocab] = self.lm.logits(h).float()
        return out

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        rows = []
        for s in seqs:
            text = torch.tensor(s.text_ids, dtype=torch.long, device=self.device)
            speech = torch.tensor(s.prompt_speech, dtype=torch.long, device=self.device)
            x = self.lm.prompt_embeds(text, speech).unsqueeze(0)
            rows.append(self._logits(self._forward(s, x, 0)))
        return torch.stack(rows)

    @torch.inference_mode()
    def decode(self, b: int, seqs: list[Sequence]) -> torch.Tensor:
        """Logits for seqs (rows 0..b-1, b == len(seqs))."""
        rows = []
        w = self.lm.speech_embedding.weight
        for s in seqs:
            x = w[s.tokens[-1]].view(1, 1, -1)
            rows.append(self._logits(self._forward(s, x, s.prompt_len + s.n_gen - 1)))
        return torch.stack(rows)
