"""Mixed steps (a prefill riding along a decode step, design.md D33) from CUDA graphs, one per
pair of a decode bucket and a prompt-token bucket.

Eager, a mixed step issues ~220 launches from the host, and inside the pipeline the host
queued it for as long as the GPU ran it; a graph replays them at once.

A pair's graph reads one static buffer: the ``TritonExecutor.prefill_inputs`` layout padded to
the token bucket (padding as ``prefill_graphs``: text id 0 at position 0 of the scratch row,
writing the scratch slot), then each new sequence's last-token index padded to ``MAX_SEQS``,
then the decode rows padded to the decode bucket with the scratch row (never bound: position 0,
an all-zero block table, so its token too attends only to the scratch slot). Padding is never
read back, and the kernels are batch invariant, so a graphed mixed step gives the eager one's
logits bit for bit. All graphs write their logits into one buffer: they replay one at a time on
the AR stream, each read (sampled) before the next replay.

Pairs are captured at their second use (the first runs eager, which warms its kernels), like
the lazy prefill buckets, or at start-up (``precapture``: ``ar.mixed_graph_precapture``); a step
beyond the buckets, or of more than ``MAX_SEQS`` new sequences, runs eager.
"""

from __future__ import annotations

import logging
import time

import torch

from cosybatch.gpu.hostcopy import copy_in, h2d

log = logging.getLogger(__name__)

# New sequences a graphed mixed step takes: under a fixed concurrency rows free up one or two
# at a time, and every padded one costs a row of logits.
MAX_SEQS = 16
# Captures listed in ``capture_log`` (a bulk run's ramp meets most of its pairs at once)
LOGGED = 32


class MixedGraphs:
    def __init__(self, executor, scratch_row: int, decode_buckets: tuple[int, ...],
                 token_buckets: tuple[int, ...], pool, graphed: bool = True):
        """``graphed`` False: every step eager (no CUDA graphs, e.g. on a CPU)."""
        self.executor = executor
        self.scratch_row = scratch_row
        self.device = executor.device
        self.pool = pool
        self._decode = tuple(sorted(decode_buckets)) if graphed else ()
        self._tokens = tuple(sorted(token_buckets)) if graphed else ()
        self._graphs: dict[tuple[int, int], tuple] = {}  # (b, t) -> (graph, static input)
        self._seen: dict[tuple[int, int], int] = {}  # uses of each pair not captured yet (failed: -1)
        self._logits = None  # [largest b + MAX_SEQS, Vp], shared by every graph
        self.replays = 0
        self.eager = 0
        # the first LOGGED captures, each [decode bucket, token bucket, host ms, at start-up]:
        # which pairs a run meets, and what capturing them inside its window costs
        self.capture_log: list[list] = []

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The (decode bucket, token bucket) pairs captured so far."""
        return tuple(sorted(self._graphs))

    @property
    def met_once(self) -> tuple[tuple[int, int], ...]:
        """The pairs a step has used once, eagerly, and that are not captured (yet)."""
        return tuple(sorted(p for p, n in self._seen.items() if n > 0 and p not in self._graphs))

    def _pair(self, d: int, t: int, k: int) -> tuple[int, int] | None:
        b = next((x for x in self._decode if x >= d), None)
        tb = next((x for x in self._tokens if x >= t), None)
        return None if b is None or tb is None or k > MAX_SEQS else (b, tb)

    def _padding(self, b: int, t: int) -> torch.Tensor:
        """A host input of ``t`` padding tokens, ``MAX_SEQS`` last-token indices of 0 and ``b``
        scratch decode rows."""
        flat = torch.zeros(5 * t + MAX_SEQS + b, dtype=torch.long)
        flat[3 * t: 4 * t] = self.scratch_row
        flat[5 * t + MAX_SEQS:] = self.scratch_row
        return flat

    @staticmethod
    def _views(flat: torch.Tensor, b: int, t: int):
        return flat[: 5 * t].view(5, t), flat[5 * t: 5 * t + MAX_SEQS], flat[5 * t + MAX_SEQS: 5 * t + MAX_SEQS + b]

    def _capture(self, b: int, t: int) -> None:
        if self._logits is None:
            rows = self._decode[-1] + MAX_SEQS
            self._logits = torch.empty(rows, self.executor.head.shape[0], dtype=torch.float32, device=self.device)
        static = self._padding(b, t).to(self.device)
        inp, last, drows = self._views(static, b, t)
        out = self._logits[: b + MAX_SEQS]
        graph, _ = self.pool.capture(lambda: out.copy_(self.executor.mixed_from(drows, inp, last)))
        self._graphs[(b, t)] = (graph, static)

    def precapture(self, pairs) -> int:
        """Capture the pairs covering these (decoding rows, prompt tokens) now, before the first
        request (the capture's own warm-up run loads their kernels); each writes only the scratch
        row. A pair outside the buckets is skipped, a failed one runs eager from then on.
        Returns how many were captured."""
        n = 0
        for d, t in pairs:
            pair = self._pair(d, t, 1)
            if pair is None or pair in self._graphs or self._seen.get(pair, 0) < 0:
                continue
            if self._try_capture(pair, startup=True):
                n += 1
            else:
                self._seen[pair] = -1
        return n

    def _try_capture(self, pair: tuple[int, int], startup: bool = False) -> bool:
        t0 = time.perf_counter()
        try:
            self._capture(*pair)
            if len(self.capture_log) < LOGGED:
                self.capture_log.append([*pair, round(1e3 * (time.perf_counter() - t0), 1), startup])
            return True
        except Exception as e:
            log.warning("CUDA graph capture failed for the mixed step of %d rows and %d prompt tokens "
                        "(it runs eager): %s", *pair, e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return False

    def run(self, d: int, inp: torch.Tensor, last: list[int]) -> torch.Tensor:
        """Logits [d + len(last), Vp] of a decode step of rows 0..d-1 with the prefill ``inp``
        (a host [5, T] tensor laid out by ``prefill_inputs``, of other rows): from the pair's
        graph, else eager from the same inputs."""
        t, k = inp.shape[1], len(last)
        pair = self._pair(d, t, k)
        if pair is not None and pair not in self._graphs and self._seen.get(pair, 0) >= 0:
            uses = self._seen[pair] = self._seen.get(pair, 0) + 1
            if uses >= 2:  # captured at its second use: the first (eager) warmed its kernels
                self._seen[pair] = 0 if self._try_capture(pair) else -1
        if pair is None or pair not in self._graphs:
            self.eager += 1
            drows = torch.arange(d, dtype=torch.long, device=self.device)
            return self.executor.mixed_from(drows, h2d(inp, device=self.device), h2d(last, torch.long, self.device))
        b, tb = pair
        graph, static = self._graphs[pair]
        flat = self._padding(b, tb)
        f_inp, f_last, f_rows = self._views(flat, b, tb)
        f_inp[:, :t] = inp
        f_last[:k] = torch.tensor(last, dtype=torch.long)
        f_rows[:d] = torch.arange(d)
        copy_in(static, flat)
        graph.replay()
        self.replays += 1
        logits = self._logits
        return torch.cat([logits[:d], logits[b: b + k]])
