"""Batched token sampling on the device: the official RAS sampler and standard sampling.

Batch invariance by construction: every step of the draw is either elementwise, an exact
reduction (max, integer sums) or a permutation (stable sort). Probabilities are turned into
fixed-point integers (``exp(score - max) * 2**40``, floored) so that every cumulative sum is an
exact int64 sum whose value cannot depend on the reduction order a kernel picks for a batch
shape. Random numbers come from ``rng.uniform(seed, token index, draw)`` (with the Triton
executor from ``triton_kernels.uniforms``, one launch with the same bits).

RAS (``cosyvoice.utils.common.ras_sampling``): sort the probabilities (stable, descending), keep
while the running sum before a token is < top_p and fewer than top_k are kept (the first token
always), draw among the kept proportionally; if the drawn id occurs >= win_size*tau_r times among
the last win_size *generated* tokens, draw again from the full distribution with that id removed.
Standard: repetition penalty (logit/p if > 0 else logit*p) on every id generated so far, applied
once per id; temperature; then the same top-k / top-p walk and draw. Early-stop masking happens
on the scores: for step i < min_len only ``sos`` (official quirk) or every stop id
(``enforce_min_len``); with ``force_length`` every stop id at every step.
"""

from __future__ import annotations

import torch

from cosybatch.engine.request import SamplingParams
from cosybatch.engine.rng import split_seed, uniforms
from cosybatch.gpu.hostcopy import copy_in

_FIXED_ONE = float(2**40)  # fixed-point scale; sums of <= 2**13 such values fit int64 exactly

# columns of the per-row parameter table (float64; every value is exact there)
_COLS = ("is_ras", "top_k", "top_p", "temperature", "penalty", "rep_threshold", "win_size",
         "seed_lo", "seed_hi", "min_len", "mask_all_early", "force")
_C = {name: i for i, name in enumerate(_COLS)}


def padded_vocab(v: int, multiple: int = 64) -> int:
    """Rows of logits are padded so that every row starts on an aligned address and no
    vectorized loop ends a row in a scalar tail."""
    return (v + multiple - 1) // multiple * multiple


class SamplerState:
    """Per-row sampling parameters, generated-token history and seen-token mask, on the device.

    Rows are the engine's decode rows; ``bind`` writes a request into a row, ``move`` copies one
    row over another (compaction), ``sample`` draws for a set of rows and ``record`` appends the
    drawn tokens."""

    def __init__(self, num_rows: int, vocab: int, stop_start: int, sos: int, history_len: int,
                 device: torch.device, uniforms=uniforms, draw=None, scores=None):
        self.vocab = vocab
        self.vocab_padded = padded_vocab(vocab)
        self.stop_start = stop_start
        self.sos = sos
        self.device = device
        # engine.rng.uniforms, or a kernel that gives the same bits (engine.triton_kernels.uniforms)
        self.uniforms = uniforms
        # None: the draw after the sort as tensor ops below; else a kernel with the same steps
        # (engine.triton_kernels.sampler_draw)
        self.draw = draw
        # None: the steps before the sort as tensor ops (``_scores``); else a kernel with the same
        # float32 operations (engine.triton_kernels.sampler_scores)
        self.scores = scores
        self.params = torch.zeros(num_rows, len(_COLS), dtype=torch.float64, device=device)
        self.history = torch.zeros(num_rows, history_len, dtype=torch.long, device=device)
        self.seen = torch.zeros(num_rows, self.vocab_padded, dtype=torch.bool, device=device)
        col = torch.arange(self.vocab_padded, device=device)
        self._col = col.unsqueeze(0)
        self._hist_col = torch.arange(history_len, device=device).unsqueeze(0)
        self._stop_cols = ((col >= stop_start) & (col < vocab)).unsqueeze(0)
        self._sos_col = (col == sos).unsqueeze(0)
        self._true = torch.ones((), dtype=torch.bool, device=device)
        # padding rows of a decode bucket are sampled too (and ignored): give every row valid
        # parameters from the start
        for row in range(num_rows):
            self.reset(row)

    # ---------------------------------------------------------------- row bookkeeping

    def bind(self, row: int, p: SamplingParams, min_len: int) -> None:
        lo, hi = split_seed(p.seed)
        vals = {
            "is_ras": 1.0 if p.mode == "ras" else 0.0,
            "top_k": float(p.top_k if p.top_k > 0 else self.vocab_padded),
            "top_p": float(p.top_p),
            "temperature": 1.0 if p.mode == "ras" else float(p.temperature),
            "penalty": 1.0 if p.mode == "ras" else float(p.repetition_penalty),
            # the official test is ``rep_num >= win_size * tau_r`` in Python floats
            "rep_threshold": float(p.win_size * p.tau_r) if p.mode == "ras" else float("inf"),
            "win_size": float(p.win_size),
            "seed_lo": float(lo),
            "seed_hi": float(hi),
            "min_len": float(min_len),
            "mask_all_early": 1.0 if p.enforce_min_len else 0.0,
            "force": 1.0 if p.force_length is not None else 0.0,
        }
        row_vals = torch.tensor([vals[c] for c in _COLS], dtype=torch.float64)
        copy_in(self.params[row], row_vals)
        self.history[row].zero_()
        self.seen[row].zero_()

    def reset(self, row: int) -> None:
        self.bind(row, SamplingParams(), 0)

    def move(self, src: int, dst: int) -> None:
        self.params[dst].copy_(self.params[src])
        self.history[dst].copy_(self.history[src])
        self.seen[dst].copy_(self.seen[src])

    # ---------------------------------------------------------------- drawing

    def sample(self, logits: torch.Tensor, rows, n_gen: torch.Tensor) -> torch.Tensor:
        """logits [n, Vp] float32 (padding columns -inf), rows (slice or LongTensor [n]) and
        n_gen [n] (tokens generated so far = index of the token being drawn) -> ids [n] int64."""
        p = self.params[rows]
        if self.scores is not None:
            scores, q = self.scores(logits, p, self.seen[rows], n_gen, _C, self.stop_start, self.vocab, self.sos,
                                    _FIXED_ONE)
        else:
            scores, q = self._scores(logits, p, self.seen[rows], n_gen)
        col = self._col

        # nucleus walk over the stable descending order
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        lo, hi = p[:, _C["seed_lo"]].long(), p[:, _C["seed_hi"]].long()
        u = self.uniforms(lo, hi, n_gen, 2)  # [n, 2]: this token's draws 0 and 1
        if self.draw is not None:  # the rest in one kernel, the same integer and float64 steps
            return self.draw(order, q, p, u, self.history[rows], n_gen, self.vocab, _C)
        qs = q.gather(1, order)
        incl = qs.cumsum(1)
        excl = incl - qs
        total = incl[:, -1:]
        k = p[:, _C["top_k"]].long().unsqueeze(1)
        top_p = p[:, _C["top_p"]].unsqueeze(1)
        kept = ((col < k) & (excl.double() < top_p * total.double())) | (col == 0)
        n_kept = kept.sum(1, keepdim=True)
        kept_total = incl.gather(1, n_kept - 1)
        t1 = torch.floor(u[:, :1] * kept_total.double()).long()
        r1 = torch.minimum(((incl <= t1) & kept).sum(1, keepdim=True), n_kept - 1)
        tok1 = order.gather(1, r1)

        # RAS: repeated within the window -> redraw from the full distribution without it
        hist = self.history[rows]
        win = p[:, _C["win_size"]].long().unsqueeze(1)
        ng = n_gen.unsqueeze(1)
        in_win = (self._hist_col >= ng - win) & (self._hist_col < ng)
        rep = ((hist == tok1) & in_win).sum(1, keepdim=True)
        is_ras = p[:, _C["is_ras"]] > 0
        hit = is_ras.unsqueeze(1) & (rep.double() >= p[:, _C["rep_threshold"]].unsqueeze(1))
        q2 = q.masked_fill(col == tok1, 0)
        incl2 = q2.cumsum(1)
        total2 = incl2[:, -1:]
        t2 = torch.floor(u[:, 1:] * total2.double()).long()
        tok2 = (incl2 <= t2).sum(1, keepdim=True)
        # nothing else has any mass left: the official multinomial would still pick the runner-up
        tok2 = torch.where(total2 > 0, tok2, order[:, 1:2]).clamp(max=self.vocab - 1)
        return torch.where(hit, tok2, tok1).squeeze(1)

    def _scores(self, logits: torch.Tensor, p: torch.Tensor, seen: torch.Tensor, n_gen: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [n, Vp] float32, q [n, Vp] int64): the logits after the repetition penalty,
        temperature and early-stop masks, and their fixed-point probabilities."""
        is_ras = p[:, _C["is_ras"]] > 0
        # standard-mode transforms (no-ops for RAS rows: penalty 1, temperature 1)
        pen = p[:, _C["penalty"]].float().unsqueeze(1)
        penalized = torch.where(logits > 0, logits / pen, logits * pen)
        scores = torch.where(seen & ~is_ras.unsqueeze(1), penalized, logits)
        scores = scores / p[:, _C["temperature"]].float().unsqueeze(1)

        early = n_gen < p[:, _C["min_len"]].long()
        mask_all = (early & (p[:, _C["mask_all_early"]] > 0)) | (p[:, _C["force"]] > 0)
        sos_only = early & ~mask_all
        kill = (mask_all.unsqueeze(1) & self._stop_cols) | (sos_only.unsqueeze(1) & self._sos_col)
        scores = scores.masked_fill(kill, float("-inf"))

        # fixed-point probabilities (unnormalised; the max id gets exactly 2**40)
        e = torch.exp(scores - scores.amax(dim=1, keepdim=True))
        return scores, torch.floor(e * _FIXED_ONE).long()

    def record(self, rows, n_gen: torch.Tensor, tokens: torch.Tensor) -> None:
        """history[row, n_gen] = token and seen[row, token] = True (rows as in ``sample``)."""
        idx = n_gen.clamp(max=self.history.shape[1] - 1).unsqueeze(1)
        if isinstance(rows, slice):
            self.history[rows].scatter_(1, idx, tokens.unsqueeze(1))
            self.seen[rows].scatter_(1, tokens.unsqueeze(1), True)
        else:  # a device value: ``seen[rows, tokens] = True`` would copy a host scalar (a sync)
            self.history[rows, idx.squeeze(1)] = tokens
            self.seen.index_put_((rows, tokens), self._true.expand(tokens.shape[0]))
