"""Runs the LM for the engine: prefill of admitted sequences, one decode step for the running
rows, sampling and per-row device state, and CUDA-graph capture/replay of the decode step (and,
through ``prefill_graphs``, of small prefills).

Decode rows are compact (the scheduler keeps running sequences in rows 0..n-1); a step runs the
smallest captured bucket >= n, and padding rows point at the scratch KV block with ``active``
false so their results are ignored and their state never advances. A step's only host sync is
reading the sampled ids.
"""

from __future__ import annotations

import logging

import torch

from cosybatch.gpu.cuda_graphs import GraphPool
from cosybatch.engine import rng
from cosybatch.engine.config import EngineConfig
from cosybatch.engine.kv_cache import PagedKVCache, plan_num_blocks
from cosybatch.engine.mixed_graphs import MixedGraphs
from cosybatch.engine.prefill_graphs import PrefillGraphs, token_buckets
from cosybatch.engine.request import Sequence
from cosybatch.engine.sampler import SamplerState, padded_vocab
from cosybatch.gpu.hostcopy import copy_in, h2d
from cosybatch.models.speech_lm import CosyVoice3LM
from cosybatch.gpu.runtime import triton_available

log = logging.getLogger(__name__)


class DecodeRows:
    """Device tensors indexed by decode row."""

    def __init__(self, num_rows: int, max_blocks: int, device: torch.device):
        z = dict(dtype=torch.long, device=device)
        self.tok = torch.zeros(num_rows, **z)  # last sampled id (the next step's input)
        self.pos = torch.zeros(num_rows, **z)  # position of that input
        self.n_gen = torch.zeros(num_rows, **z)  # tokens generated so far
        self.active = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.block_tables = torch.zeros(num_rows, max_blocks, dtype=torch.int32, device=device)
        self.out = torch.zeros(num_rows, **z)  # ids drawn by the last decode step

    def tensors(self):
        return (self.tok, self.pos, self.n_gen, self.active, self.block_tables, self.out)


class ModelRunner:
    def __init__(self, lm: CosyVoice3LM, cfg: EngineConfig):
        self.cfg = cfg
        self.lm = lm
        self.device = lm.speech_embedding.weight.device
        q = lm.cfg.qwen
        executor = cfg.executor
        if executor == "auto":
            executor = "triton" if self.device.type == "cuda" and triton_available() else "torch"
        self.dtype = lm.speech_embedding.weight.dtype if executor == "torch" else cfg.torch_dtype(self.device)
        self.num_blocks = plan_num_blocks(cfg, q.num_hidden_layers, q.num_key_value_heads, q.head_dim, self.dtype)
        self.cache = PagedKVCache(q.num_hidden_layers, self.num_blocks, cfg.kv_block_size,
                                  q.num_key_value_heads, q.head_dim, self.dtype, self.device)
        self.vocab_padded = padded_vocab(lm.cfg.speech_vocab)
        self.num_rows = cfg.max_num_seqs
        self.max_blocks = -(-cfg.max_model_len // cfg.kv_block_size) + 1
        # one more row than decode uses: the scratch row that a graphed prefill's padding reads
        self.rows = DecodeRows(self.num_rows + 1, self.max_blocks, self.device)
        uniforms, draw, scores = rng.uniforms, None, None
        if executor == "triton" and cfg.sampler_kernels:  # the same bits, ~280 launches fewer
            from cosybatch.engine.triton_kernels import sampler_draw as draw, sampler_scores as scores, uniforms
        self.sampler = SamplerState(self.num_rows, lm.cfg.speech_vocab, lm.cfg.speech_token_size,
                                    lm.cfg.sos, cfg.max_model_len, self.device, uniforms, draw, scores)
        if executor == "torch":
            from cosybatch.engine.torch_executor import TorchExecutor

            self.executor = TorchExecutor(lm, self.cache, self.vocab_padded)
        else:
            from cosybatch.engine.triton_executor import TritonExecutor

            self.executor = TritonExecutor(lm, self.cache, self.rows, self.vocab_padded, self.dtype,
                                           cfg.linear, cfg.rope_in_attention, cfg.mixed_prefill)
        # rows are sampled one at a time off-GPU: CPU kernels split work by tensor size, so a
        # batched elementwise op could round a row differently from the same row alone
        self._rowwise = self.device.type != "cuda"
        self._pending_n = 0
        if self.device.type == "cuda":
            self._host_out = torch.zeros(self.num_rows, dtype=torch.long).pin_memory()
            self._out_ready = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_modes: dict[int, str] = {}
        self._logit_bufs: dict[int, torch.Tensor] = {}  # buckets graphed without their sampling
        self._graph_pool = GraphPool()  # one pool: at start-up largest first, so the smaller reuse its memory
        self.prefill_graphs: PrefillGraphs | None = None
        self.graphed = cfg.cuda_graphs and self.device.type == "cuda" and self.executor.graphable
        if self.graphed and cfg.graph_capture == "startup":
            self.capture_graphs()
        elif self.graphed:  # lazy: each bucket when the run first needs it (``decode_launch``, ``PrefillGraphs.run``)
            self._prefill_graphs(capture=False)
            if cfg.graph_capture == "warm":
                self.warm_kernels()
            self.reset_rows()
        # mixed steps (design.md D33): each pair of buckets captured at its second use, always lazily
        # (few of the pairs a run could meet are met); eager without graphs
        self.mixed_graphs: MixedGraphs | None = None
        if self.mixes:
            self.mixed_graphs = MixedGraphs(self.executor, self.num_rows, cfg.buckets(), self._token_buckets(),
                                            self._graph_pool, graphed=self.graphed)
            if self.graphed and cfg.mixed_graph_precapture:
                n = self.mixed_graphs.precapture(cfg.mixed_graph_precapture)
                log.info("AR mixed-step graphs captured at start-up: %d of %d pairs", n, len(cfg.mixed_graph_precapture))

    # ---------------------------------------------------------------- rows

    # Row state is written with fill_/zero_ kernels: ``cuda_tensor[i] = 0`` copies a CPU
    # scalar from pageable memory, which waits for every kernel queued before it (a sync per
    # write; H200 synth: ~4 ms per finished row while the codec's work was queued).
    def bind(self, seq: Sequence, row: int) -> None:
        r = self.rows
        table = torch.zeros(self.max_blocks, dtype=torch.int32)
        table[: len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        copy_in(r.block_tables[row], table)
        self._clear(row, active=True)
        self.sampler.bind(row, seq.params, seq.min_len)

    def unbind(self, row: int) -> None:
        self.rows.block_tables[row].zero_()
        self._clear(row, active=False)
        self.sampler.reset(row)

    def _clear(self, row: int, active: bool) -> None:
        r = self.rows
        for t in (r.tok, r.pos, r.n_gen):
            t[row].zero_()
        r.active[row].fill_(active)

    def move(self, src: int, dst: int) -> None:
        for t in self.rows.tensors():
            t[dst] = t[src]
        self.sampler.move(src, dst)

    # ---------------------------------------------------------------- steps

    def _sample_record(self, logits: torch.Tensor, rows, n_gen: torch.Tensor) -> torch.Tensor:
        if not self._rowwise:
            toks = self.sampler.sample(logits, rows, n_gen)
            self.sampler.record(rows, n_gen, toks)
            return toks
        idx = range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()
        out = []
        for j, r in enumerate(idx):
            one = slice(r, r + 1)
            t = self.sampler.sample(logits[j: j + 1], one, n_gen[j: j + 1])
            self.sampler.record(one, n_gen[j: j + 1], t)
            out.append(t)
        return torch.cat(out)

    @torch.inference_mode()
    def prefill_launch(self, seqs: list[Sequence]) -> None:
        """Enqueue the prefill of newly admitted sequences and their first sampled ids;
        ``collect`` returns those ids."""
        for s in seqs:
            self.bind(s, s.row)
        if self.prefill_graphs is not None:
            logits = self.prefill_graphs.run(*self.executor.prefill_inputs(seqs))
        else:
            logits = self.executor.prefill(seqs)
        rows = h2d([s.row for s in seqs], torch.long, self.device)
        zeros = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        toks = self._sample_record(logits, rows, zeros)
        self._start_rows(rows, seqs, toks)
        self._publish(toks, len(seqs))

    def _start_rows(self, rows: torch.Tensor, seqs: list[Sequence], toks: torch.Tensor) -> None:
        """Newly prefilled rows: their first id, the position past the prompt, one id generated."""
        r = self.rows
        r.tok[rows] = toks
        r.pos[rows] = h2d([s.prompt_len for s in seqs], torch.long, self.device)
        r.n_gen.index_fill_(0, rows, 1)

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        self.prefill_launch(seqs)
        return self.collect()

    @property
    def mixes(self) -> bool:
        """Whether a prefill can ride along a decode step (``mixed_prefill``, Triton executor)."""
        return self.cfg.mixed_prefill and hasattr(self.executor, "mixed_from")

    @torch.inference_mode()
    def mixed_launch(self, decoding: list[Sequence], seqs: list[Sequence]) -> None:
        """Enqueue one decode step of ``decoding`` (rows 0..b-1) with the prefill of the newly
        admitted ``seqs`` (rows b..) in one forward (design.md D33); ``collect`` returns the
        decode rows' ids, then the new rows' first ids. From a graph per pair of buckets once
        the pair comes back (``mixed_graphs``), else eager."""
        b, n = len(decoding), len(decoding) + len(seqs)
        for s in seqs:
            self.bind(s, s.row)
        logits = self.mixed_graphs.run(b, *self.executor.prefill_inputs(seqs))
        r = self.rows
        n_gen = torch.cat([r.n_gen[:b], torch.zeros(len(seqs), dtype=torch.long, device=self.device)])
        toks = self._sample_record(logits, slice(0, n), n_gen)
        self._step_rows(b, toks[:b])  # the decode rows as a decode step leaves them
        self._start_rows(h2d([s.row for s in seqs], torch.long, self.device), seqs, toks[b:])  # the new ones as a prefill
        r.out[:n].copy_(toks)
        self._publish(r.out[:n], n)

    def _decode_step(self, b: int, seqs: list[Sequence] | None, logits: torch.Tensor | None = None) -> None:
        r = self.rows
        if logits is None:
            logits = self.executor.decode(b, seqs)
        n_gen = r.n_gen[:b]
        toks = self._sample_record(logits, slice(0, b), n_gen)
        self._step_rows(b, toks)
        r.out[:b].copy_(toks)

    def _step_rows(self, b: int, toks: torch.Tensor) -> None:
        """Rows 0..b-1 after a decode step: the active ones take their new id and advance."""
        r = self.rows
        act = r.active[:b]
        r.tok[:b].copy_(torch.where(act, toks, r.tok[:b]))
        r.pos[:b] += act
        r.n_gen[:b] += act

    def bucket(self, n: int) -> int:
        for b in self.cfg.buckets():
            if b >= n:
                return b
        raise ValueError(f"{n} rows exceed max_num_seqs={self.cfg.max_num_seqs}")

    @torch.inference_mode()
    def decode_launch(self, seqs: list[Sequence]) -> None:
        """Enqueue one decode step for the running sequences (seqs[i] sits in row i) and an
        asynchronous copy of its ids to pinned host memory; ``decode_collect`` waits for them."""
        n = len(seqs)
        b = None
        if self.executor.graphable:
            b = self.bucket(n)
            g = self.graphs.get(b)
            if g is None:
                self._decode_step(b, None)
            elif b in self._logit_bufs:
                g.replay()
                self._decode_step(b, None, self._logit_bufs[b])
            else:
                g.replay()
        else:
            self._decode_step(n, seqs)
        self._publish(self.rows.out[:n], n)
        if self.graphed and b not in self.graph_modes:
            # Lazy capture: this eager step was the bucket's warm-up (its kernels are loaded);
            # the capture only records (it runs nothing), so the rows' state is not stepped
            # twice. A capture that fails leaves the bucket eager, with a warning.
            self._capture_bucket(b, warmup=0)

    def _publish(self, toks: torch.Tensor, n: int) -> None:
        """Queue the step's ids for the host: on CUDA an asynchronous copy into pinned memory and
        an event, so the host can queue more work before it reads them."""
        if self.device.type == "cuda":
            self._host_out[:n].copy_(toks, non_blocking=True)
            self._out_ready.record()
        else:
            self._cpu_out = toks
        self._pending_n = n

    def collect(self) -> list[int]:
        """The ids of the step launched last (waits for that step, not for later work)."""
        n = self._pending_n
        if self.device.type == "cuda":
            self._out_ready.synchronize()  # the step's one host sync
            return self._host_out[:n].tolist()
        return self._cpu_out[:n].tolist()

    def step_done(self) -> bool:
        """Whether the step launched last has finished on the device (never blocks)."""
        return self.device.type != "cuda" or self._out_ready.query()

    def decode(self, seqs: list[Sequence]) -> list[int]:
        self.decode_launch(seqs)
        return self.collect()

    @property
    def can_run_ahead(self) -> bool:
        """Whether a decode step can be enqueued before the host has seen the previous one: only
        when the step reads nothing but device state."""
        return self.executor.graphable

    # ---------------------------------------------------------------- CUDA graphs

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every bucket before the first request, largest first so the smaller ones reuse
        its memory pool. Rows are all inactive meanwhile, so warm-up leaves no state behind. A
        bucket whose whole step (forward + sampling + state update) cannot be captured falls back
        to a graph of the forward alone with eager sampling, then to eager, with a warning."""
        self.executor.warmup(self.cfg.buckets())
        for b in sorted(self.cfg.buckets(), reverse=True):
            self._capture_bucket(b)
        self._prefill_graphs(capture=True)
        torch.cuda.synchronize(self.device)
        self.reset_rows()

    @torch.inference_mode()
    def warm_kernels(self) -> None:
        """``graph_capture: warm``: every kernel a run's steps use, run once now, so that no step
        inside the run pays a kernel's first load (a bulk run's first prefill took 0.73 s for one
        row): one eager decode step on inactive rows (the sampler's kernels with it) and padded
        prefills on the scratch row (``PrefillGraphs.warm``). Nothing is captured; the caller
        resets the rows, as after a start-up capture."""
        self._decode_step(1, None)
        if self.prefill_graphs is not None:
            self.prefill_graphs.warm()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _token_buckets(self) -> tuple[int, ...]:
        """The prompt-token buckets graphed prefills (and mixed steps) replay."""
        largest = min(self.cfg.prefill_graph_tokens, self.cfg.max_prefill_tokens)
        return token_buckets(largest) if largest > 0 else ()

    def _prefill_graphs(self, capture: bool) -> None:
        buckets = self._token_buckets()
        if buckets:
            self.prefill_graphs = PrefillGraphs(self.executor, self.num_rows, self.num_rows, buckets,
                                                self._graph_pool, capture=capture)

    @torch.inference_mode()
    def _capture_bucket(self, b: int, warmup: int = 1) -> None:
        """Decode bucket ``b`` as a graph of the whole step, else of the forward alone, else
        eager (recorded in ``graph_modes``; a failure is logged, never raised)."""
        for mode in ("step", "forward"):
            try:
                self._capture(b, mode, warmup)
                self.graph_modes[b] = mode
                return
            except Exception as e:
                log.warning("CUDA graph capture (%s) failed for decode bucket %d: %s", mode, b, e)
                torch.cuda.synchronize(self.device)
        self.graph_modes[b] = "eager"

    def _capture(self, b: int, mode: str, warmup: int = 1) -> None:
        if mode == "step":
            fn = lambda: self._decode_step(b, None)  # noqa: E731
        else:
            buf = torch.empty(b, self.vocab_padded, dtype=torch.float32, device=self.device)
            fn = lambda: buf.copy_(self.executor.decode(b))  # noqa: E731
        g, _ = self._graph_pool.capture(fn, warmup=warmup)  # warm-up: this exact shape first
        self.graphs[b] = g
        if mode == "forward":
            self._logit_bufs[b] = buf
        else:
            self._logit_bufs.pop(b, None)

    def reset_rows(self) -> None:
        for row in range(self.num_rows):
            self.unbind(row)
