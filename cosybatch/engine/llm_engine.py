"""The in-process AR engine: add requests, step, stream tokens out.

    engine = LLMEngine(lm, engine_config(max_num_seqs=64))  # cosybatch.profiles.resolve
    rid = engine.add_request(text_ids, prompt_text_ids, prompt_speech, SamplingParams.ras(cfg, seed=7),
                             on_tokens=callback)
    while engine.has_unfinished():
        engine.step()

``on_tokens(request_id, tokens, finished)`` receives the flow-bound stream (silent-filtered) as it
grows; ``Sequence.tokens`` keeps the raw ids the LM conditioned on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from cosybatch.engine.config import EngineConfig
from cosybatch.engine.kv_cache import BlockAllocator
from cosybatch.engine.model_runner import ModelRunner
from cosybatch.engine.request import (RequestFailed, RequestOutput, SamplingParams, Sequence, SeqStatus,
                                      TokenCallback, as_int_list, length_limits)
from cosybatch.engine.scheduler import Scheduler, StepPlan
from cosybatch.models.speech_lm import CosyVoice3LM

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    prefill_steps: int = 0
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    mixed_steps: int = 0  # decode steps that carried a prefill (design.md D33): counted in both
    batch_hist: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, lm: CosyVoice3LM, config: EngineConfig):
        self.cfg = config
        self.lm = lm.eval()
        self.llm_cfg = lm.cfg
        self.runner = ModelRunner(self.lm, self.cfg)
        self.scheduler = Scheduler(self.cfg.max_num_seqs, BlockAllocator(self.runner.num_blocks),
                                   self.cfg.kv_block_size, self.cfg.max_prefill_tokens,
                                   self.cfg.prefill_min_rows, self.cfg.prefill_wait_ms / 1e3)
        self.scheduler.mixed = self.runner.mixes
        self.stop_start = self.llm_cfg.speech_token_size
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._inflight: tuple[StepPlan, float] | None = None  # a launched step not yet collected
        self._abort_later: set[str] = set()  # aborts that arrived while a step was in flight
        self._min_left = 0
        self._run_ahead = self.runner.can_run_ahead

    # ---------------------------------------------------------------- requests

    def add_request(self, text_ids, prompt_text_ids, prompt_speech_tokens,
                    params: SamplingParams | None = None, request_id: str | None = None,
                    on_tokens: TokenCallback | None = None) -> str:
        """text_ids: target text tokens of one segment; prompt_text_ids: the prompt transcript
        (with the system prefix); prompt_speech_tokens: the prompt's speech tokens."""
        params = params or SamplingParams.ras(self.llm_cfg.sampling)
        text = as_int_list(text_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs and self.seqs[rid].status != SeqStatus.FINISHED:
            raise ValueError(f"request id {rid!r} is already in flight")
        min_len, max_len = length_limits(len(text), params, self.cfg.min_token_text_ratio,
                                         self.cfg.max_token_text_ratio)
        seq = Sequence(rid, as_int_list(prompt_text_ids) + text, as_int_list(prompt_speech_tokens),
                       params, min_len, max_len, on_tokens)
        if seq.max_total_len > self.cfg.max_model_len:
            raise ValueError(f"request {rid}: prompt {seq.prompt_len} + max_len {max_len} tokens exceed "
                             f"max_model_len={self.cfg.max_model_len}")
        if not self.scheduler.fits_ever(seq):
            raise ValueError(f"request {rid}: needs more KV blocks than the cache has")
        self.seqs[rid] = seq
        if max_len <= 0:  # the official loop runs zero steps
            self._finish(seq, "length", register=False)
            return rid
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request now (its row failed elsewhere) and free its slot and KV blocks. With a
        step in flight, the request is stopped when that step is collected (rows can only move
        between steps)."""
        if self._inflight is not None and request_id in self.seqs:
            self._abort_later.add(request_id)
            return
        seq = self.seqs.pop(request_id, None)
        if seq is None or seq.status == SeqStatus.FINISHED:
            return
        if seq.status == SeqStatus.WAITING:
            self.scheduler.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
        else:
            self._finish(seq, "abort", register=True, announce=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def result(self, request_id: str) -> list[int]:
        return list(self.seqs[request_id].tokens)

    def pop_result(self, request_id: str) -> Sequence:
        seq = self.seqs[request_id]
        if seq.status != SeqStatus.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished")
        return self.seqs.pop(request_id)

    # ---------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        """Launch the next step and wait for it (``launch`` + ``collect``)."""
        self.launch()
        return self.collect()

    def launch(self) -> bool:
        """Enqueue the next step (a prefill of newly admitted requests, or one decode step of
        every running row, or with ``mixed_prefill`` both in one) without waiting for it; True
        if a step is in flight."""
        if self._inflight is not None:
            return True
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        t0 = time.perf_counter()
        if plan.kind == "decode":
            self.runner.decode_launch(plan.seqs)
        else:
            try:
                if plan.kind == "mixed":
                    self.runner.mixed_launch(plan.decode, plan.seqs)
                else:
                    self.runner.prefill_launch(plan.seqs)
            except torch.OutOfMemoryError:
                self._prefill_out_of_memory(plan.seqs)
                return False
        self._inflight = (plan, t0)
        return True

    def _prefill_out_of_memory(self, seqs: list[Sequence]) -> None:
        """A prefill's activations did not fit: undo the admission and retry with half the
        tokens per prefill (kept lowered: the memory will be as tight next time). A request
        too long to prefill even alone is dropped with ``RequestFailed``; the rest go on."""
        for s in seqs:
            self.runner.unbind(s.row)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(seqs) == 1:
            seq = seqs[0]
            self._finish(seq, "error", register=True, announce=False)
            self.seqs.pop(seq.request_id, None)
            raise RequestFailed(seq.request_id, f"out of GPU memory in the prefill of its "
                                                f"{seq.prompt_len} prompt tokens")
        self.scheduler.unadmit(seqs)
        tokens = sum(s.prompt_len for s in seqs)
        self.scheduler.max_prefill_tokens = max(1, min(self.scheduler.max_prefill_tokens, tokens) // 2)
        log.warning("out of GPU memory in a prefill of %d requests (%d tokens): retrying with at "
                    "most %d prompt tokens per prefill", len(seqs), tokens, self.scheduler.max_prefill_tokens)

    @property
    def decoding_rows(self) -> int:
        """Sequences admitted to the decode batch (what one AR step serves)."""
        return len(self.scheduler.running)

    @property
    def waiting_rows(self) -> int:
        """Sequences admitted to the engine that wait for a row of the decode batch."""
        return len(self.scheduler.waiting)

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def prefilling(self) -> int:
        """Sequences the step in flight prefills (0 for a decode step or none in flight)."""
        return 0 if self._inflight is None or self._inflight[0].kind == "decode" else len(self._inflight[0].seqs)

    def step_done(self) -> bool:
        """Whether the step in flight has finished on the device (never blocks)."""
        return self._inflight is None or self.runner.step_done()

    def collect(self) -> list[RequestOutput]:
        """Wait for the step in flight and advance its requests; [] if none is in flight."""
        if self._inflight is None:
            return []
        (plan, t0), self._inflight = self._inflight, None
        toks = self.runner.collect()
        if plan.kind == "decode":
            outputs = self._after_decode(plan.seqs, toks, t0)
        else:
            outputs = []
            if plan.kind == "mixed":  # the decode rows' ids first (no run-ahead: the rows changed)
                b = len(plan.decode)
                outputs = self._after_decode(plan.decode, toks[:b], t0, run_ahead=False)
                toks = toks[b:]
                self.stats.mixed_steps += 1
            st = self.stats
            st.prefill_steps += 1
            st.prefill_seqs += len(plan.seqs)
            st.prefill_tokens += sum(s.prompt_len for s in plan.seqs)
            st.prefill_s += time.perf_counter() - t0
            outputs += self._advance_all(plan.seqs, toks)
            self._min_left = min((s.max_len - s.n_gen for s in self.scheduler.running), default=0)
        if self._abort_later and self._inflight is None:
            for rid in list(self._abort_later):
                self.abort(rid)
            self._abort_later.clear()
        return outputs

    def _advance_all(self, seqs: list[Sequence], toks: list[int]) -> list[RequestOutput]:
        return [self._advance(seq, tok) for seq, tok in zip(seqs, toks) if seq.request_id not in self._abort_later]

    def _after_decode(self, seqs: list[Sequence], toks: list[int], t0: float,
                      run_ahead: bool = True) -> list[RequestOutput]:
        # Nothing in this step ends a row and nobody can be admitted: the rows of the next step
        # are these rows, so enqueue it now and let the GPU run while the host does bookkeeping.
        if (run_ahead and self._run_ahead and max(toks) < self.stop_start and self._min_left > 1
                and not self.scheduler.can_admit() and not self._abort_later):
            self.runner.decode_launch(seqs)
            self._inflight = (StepPlan("decode", seqs), time.perf_counter())
        outputs = self._advance_all(seqs, toks)
        self._min_left = min((s.max_len - s.n_gen for s in self.scheduler.running), default=0)
        st = self.stats
        st.decode_steps += 1
        st.decode_tokens += len(toks)
        st.decode_s += time.perf_counter() - t0
        st.batch_hist[len(toks)] = st.batch_hist.get(len(toks), 0) + 1
        return outputs

    def _advance(self, seq: Sequence, tok: int) -> RequestOutput:
        new_flow: list[int] = []
        new_raw: list[int] = []
        reason = None
        if tok >= self.stop_start:
            reason = "stop"
        else:
            new_raw.append(tok)
            kept = seq.accept(tok)
            if kept is not None:
                new_flow.append(kept)
            if seq.n_gen >= seq.max_len:
                reason = "length"
        if reason is not None:
            self._finish(seq, reason, register=True, announce=False)
        if seq.on_tokens is not None and (new_flow or reason is not None):
            seq.on_tokens(seq.request_id, new_flow, reason is not None)
        return RequestOutput(seq.request_id, new_flow, new_raw, reason is not None, reason)

    def _finish(self, seq: Sequence, reason: str, register: bool, announce: bool = True) -> None:
        seq.finish_reason = reason
        if register:
            row = seq.row
            moved = self.scheduler.finish(seq)
            if moved is None:
                self.runner.unbind(row)
            else:
                src, dst = moved
                self.runner.move(src, dst)
                self.runner.unbind(src)
        seq.status = SeqStatus.FINISHED
        if announce and seq.on_tokens is not None:
            seq.on_tokens(seq.request_id, [], True)

    def run(self) -> dict[str, list[int]]:
        """Step until every request has finished; raw tokens of the requests finished meanwhile."""
        done: dict[str, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = self.seqs[out.request_id].tokens
        return done

    def generate(self, requests: list[dict]) -> list[list[int]]:
        """Convenience: each dict holds add_request's keyword arguments; returns raw tokens in
        request order."""
        ids = [self.add_request(**r) for r in requests]
        self.run()
        return [self.seqs[i].tokens for i in ids]

    @property
    def device(self) -> torch.device:
        return self.runner.device
