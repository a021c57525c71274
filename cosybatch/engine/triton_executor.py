"""Packed forward on the GPU with the Triton kernels: many prompts in one prefill (no padding),
one decode token per row, all reading/writing the paged cache.

The weights are the ``CosyVoice3LM``'s own, copied once into the engine dtype (q/k/v fused;
gate/up fused as (gate, up) row pairs, so SiLU x up runs in that GEMM's epilogue; the speech
head padded to an aligned vocabulary with a -inf bias on the padding).
The decode forward reads only device state (``DecodeRows``), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cosybatch.engine import triton_kernels as K
from cosybatch.engine.kv_cache import PagedKVCache
from cosybatch.engine.request import Sequence
from cosybatch.gpu.hostcopy import h2d
from cosybatch.models.speech_lm import CosyVoice3LM


@dataclass
class _Layer:
    ln1: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    w_o: torch.Tensor
    ln2: torch.Tensor
    w_gu: torch.Tensor
    w_down: torch.Tensor


class TritonExecutor:
    name = "triton"
    graphable = True

    def __init__(self, lm: CosyVoice3LM, cache: PagedKVCache, rows, vocab_padded: int,
                 dtype: torch.dtype, linear: str = "triton", rope_in_attention: bool = False,
                 mixed_prefill: bool = False):
        q = lm.cfg.qwen
        self.cache = cache
        self.rows = rows
        self.device = lm.speech_embedding.weight.device
        self.dtype = dtype
        self.hq, self.hkv, self.d = q.num_attention_heads, q.num_key_value_heads, q.head_dim
        self.eps = q.rms_norm_eps
        self.scale = self.d ** -0.5
        self.linear_impl = linear
        self.rope_in_attention = rope_in_attention
        # The matmul tiles prefills run on: their own, or (when prefills ride along decode steps,
        # design.md D33) the decode phase's, so that a prompt's tokens get the same bits whichever
        # way it was prefilled.
        self.prefill_tiles = "decode" if mixed_prefill else "prefill"
        if cache.block_size < 16 or cache.block_size & (cache.block_size - 1):
            raise ValueError("the triton executor needs a power-of-two kv_block_size >= 16")

        def prep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=self.device, dtype=dtype).contiguous()

        bb = lm.backbone
        self.layers = []
        for L in bb.layers:
            a, m = L.self_attn, L.mlp
            self.layers.append(_Layer(
                ln1=prep(L.input_layernorm.weight),
                w_qkv=prep(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                b_qkv=prep(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])),
                w_o=prep(a.o_proj.weight),
                ln2=prep(L.post_attention_layernorm.weight),
                w_gu=prep(K.gate_up_pairs(m.gate_proj.weight, m.up_proj.weight)),
                w_down=prep(m.down_proj.weight),
            ))
        self.norm = prep(bb.norm.weight)
        self.embed_text = prep(bb.embed_tokens.weight)
        self.embed_speech = prep(lm.speech_embedding.weight)
        v, hidden = lm.llm_decoder.weight.shape
        head = torch.zeros(vocab_padded, hidden, dtype=dtype, device=self.device)
        head[:v] = prep(lm.llm_decoder.weight)
        self.head = head
        self.head_bias = torch.zeros(vocab_padded, dtype=torch.float32, device=self.device)
        self.head_bias[v:] = float("-inf")
        # rotary table of HF Qwen2 (float32 angles), one row per position
        max_pos = rows.block_tables.shape[1] * cache.block_size
        inv = bb.rotary.inv_freq(self.device)
        ang = torch.arange(max_pos, device=self.device, dtype=torch.float32).unsqueeze(1) * inv.unsqueeze(0)
        self.cos, self.sin = ang.cos().contiguous(), ang.sin().contiguous()
        self.sos, self.task_id = lm.cfg.sos, lm.cfg.task_id
        self._arange = torch.arange(rows.tok.shape[0], device=self.device, dtype=torch.long)

    # ---------------------------------------------------------------- building blocks

    def _mm(self, x, w, bias=None, phase="decode", out_dtype=None):
        if self.linear_impl == "torch" and out_dtype is None:
            return F.linear(x, w, bias)
        return K.matmul(x, w, bias, out_dtype=out_dtype, phase=phase)

    def _forward(self, x, pos, tok_rows, slots, phase: str, one_per_row: bool = False) -> torch.Tensor:
        """x [T, H] inputs -> post-final-norm hidden [T, H]. ``phase``: the matmul tiles;
        ``one_per_row``: one token of each row (a decode step), which the fused RoPE attention
        serves."""
        bt = self.rows.block_tables
        h = K.rmsnorm(x, self.layers[0].ln1, self.eps)
        res = x
        n = len(self.layers)
        for i, L in enumerate(self.layers):
            kc, vc = self.cache.k[i], self.cache.v[i]
            qkv = self._mm(h, L.w_qkv, L.b_qkv, phase)
            if one_per_row and self.rope_in_attention:  # one query per row: one launch
                a = K.rope_paged_attention(qkv, pos, slots, self.cos, self.sin, kc, vc, bt, tok_rows, self.scale,
                                           self.hq, self.hkv, self.d)
            else:
                k_slots, v_slots = self.cache.flat_slots(i)
                q = K.rope_cache(qkv, pos, slots, self.cos, self.sin, k_slots, v_slots, self.hq, self.hkv, self.d)
                a = K.paged_attention(q, kc, vc, bt, tok_rows, pos, self.scale)
            h, res = K.add_rmsnorm(self._mm(a, L.w_o, None, phase), res, L.ln2, self.eps)
            if self.linear_impl == "torch":
                act = K.silu_mul(F.linear(h, L.w_gu), pairs=True)
            else:  # SiLU x up in the gate/up GEMM's epilogue
                act = K.matmul(h, L.w_gu, phase=phase, silu_pairs=True)
            mlp = self._mm(act, L.w_down, None, phase)
            nxt = self.layers[i + 1].ln1 if i + 1 < n else self.norm
            h, res = K.add_rmsnorm(mlp, res, nxt, self.eps)
        return h

    def _logits(self, h) -> torch.Tensor:
        return K.matmul(h, self.head, self.head_bias, out_dtype=torch.float32, phase="decode")

    # ---------------------------------------------------------------- phases

    # Prefill inputs travel as one [5, T] long tensor (ids, is_speech, pos, row, slot per
    # token) and the index of each sequence's last token: one host-to-device copy, and the
    # layout a captured prefill graph (``prefill_graphs``) reads from its static buffers.
    def prefill_inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        ids, is_speech, pos, rows, slots, last = [], [], [], [], [], []
        bs = self.cache.block_size
        for s in seqs:
            seq_ids = [self.sos] + s.text_ids + [self.task_id] + s.prompt_speech
            n = len(seq_ids)
            ids += seq_ids
            is_speech += [1] + [0] * len(s.text_ids) + [1] * (len(s.prompt_speech) + 1)
            pos += range(n)
            rows += [s.row] * n
            slots += PagedKVCache.slots_for(s.blocks, 0, n, bs)
            last.append(len(ids) - 1)
        return torch.tensor([ids, is_speech, pos, rows, slots], dtype=torch.long), last

    def prefill_from(self, inp: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Logits [len(last), Vp] of a prefill laid out by ``prefill_inputs``, on the device
        (reads nothing from the host: graph-capturable)."""
        h = self._forward(self._prefill_embeddings(inp), inp[2], inp[3], inp[4], self.prefill_tiles)
        return self._logits(h.index_select(0, last).contiguous())

    def _prefill_embeddings(self, inp: torch.Tensor) -> torch.Tensor:
        ids, sp = inp[0], inp[1].bool()
        return torch.where(sp.unsqueeze(1),
                           self.embed_speech[torch.where(sp, ids, 0)],
                           self.embed_text[torch.where(sp, 0, ids)]).contiguous()

    def mixed_from(self, drows: torch.Tensor, inp: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Logits [len(drows) + len(last), Vp]: the decode token of each row in ``drows`` (from
        device state, as ``decode``) and a prefill laid out by ``prefill_inputs`` (of other
        rows), in one forward on the decode phase's tiles (design.md D33); on the device only
        (graph-capturable: ``mixed_graphs`` pads ``drows`` with the scratch row). Every kernel
        computes a token alone -- the matmuls on tiles that do not depend on the token count,
        the norms and the attention per token -- so each row's logits are those of a decode step
        or a prefill of its own."""
        r, b = self.rows, drows.shape[0]
        x = torch.cat([self.embed_speech[r.tok[drows]], self._prefill_embeddings(inp)])
        pos = r.pos[drows]
        h = self._forward(x, torch.cat([pos, inp[2]]), torch.cat([drows, inp[3]]),
                          torch.cat([self._slots(pos, r.block_tables[drows]), inp[4]]), "decode")
        pick = torch.cat([self._arange[:b], last + b])
        return self._logits(h.index_select(0, pick).contiguous())

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        inp, last = self.prefill_inputs(seqs)
        return self.prefill_from(h2d(inp, device=self.device), h2d(last, torch.long, self.device))

    def decode(self, b: int, seqs=None) -> torch.Tensor:
        """Logits [b, Vp] for rows 0..b-1 from device state only (graph-capturable)."""
        r = self.rows
        x = self.embed_speech[r.tok[:b]]
        h = self._forward(x, r.pos[:b], self._arange[:b], self._decode_slots(b), "decode", one_per_row=True)
        return self._logits(h)

    def _decode_slots(self, b: int) -> torch.Tensor:
        """The cache slot of rows 0..b-1's next token."""
        return self._slots(self.rows.pos[:b], self.rows.block_tables[:b])

    def _slots(self, pos: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The cache slot of a token at each position ``pos`` of the row whose block table is
        the same row of ``tables``."""
        bs = self.cache.block_size
        blk = tables.gather(1, torch.div(pos, bs, rounding_mode="floor").unsqueeze(1))
        return blk.squeeze(1).long() * bs + pos % bs

    def warmup(self, buckets) -> None:
        """Compile every kernel variant once before graph capture."""
        for b in buckets:
            self.decode(b)
