"""Prefill from CUDA graphs, one per packed-token bucket.

An eager prefill issues ~170 Triton launches whatever its size, so the prefill of one or a
few prompts (how requests trickle in under a fixed concurrency) costs ~17-21 ms of launch
time for ~1 ms of arithmetic. A graph per token bucket replays them at once.

A bucket's graph reads one static buffer: the ``TritonExecutor.prefill_inputs`` layout
padded to the bucket, then each sequence's last-token index padded to ``max_seqs``. Padding
tokens are text id 0 at position 0 of the scratch row (a decode row no sequence ever uses,
whose block table is all zeros) writing the scratch slot 0: they attend only to that slot,
and their outputs are never read. The kernels are batch invariant (a token's bits never
depend on how many tokens share the launch), so a graphed prefill equals the eager one bit
for bit. Larger prefills run eager: there the launches are a small share.

Buckets are captured before the first request, or (``capture=False``, the engine's lazy
``graph_capture``) at their second use: a bucket a run meets once (a job's first, bulk
prefill) is never captured, one it meets again is from then on.
"""

from __future__ import annotations

import logging

import torch

from cosybatch.gpu.cuda_graphs import GraphPool
from cosybatch.gpu.hostcopy import copy_in, h2d

log = logging.getLogger(__name__)


def token_buckets(largest: int, smallest: int = 128) -> tuple[int, ...]:
    """Geometric (x1.5) multiples of 64 from ``smallest`` up to and including ``largest``."""
    out, b = [], smallest
    while b * 1.2 < largest:
        out.append(b)
        b = -(-int(b * 1.5) // 64) * 64
    return tuple(out) + (largest,) if largest >= smallest else ()


class PrefillGraphs:
    def __init__(self, executor, scratch_row: int, max_seqs: int, buckets: tuple[int, ...], pool: GraphPool,
                 capture: bool = True):
        self.executor = executor
        self.scratch_row = scratch_row
        self.max_seqs = max_seqs
        self.device = executor.device
        self.pool = pool
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph, static input, logits)
        self._planned = tuple(sorted(buckets))
        self._seen: dict[int, int] = {}  # lazy: uses of each bucket not captured yet (failed ones: -1)
        self.replays = 0
        self.eager = 0
        if capture:
            for b in sorted(buckets, reverse=True):  # largest first: the smaller reuse its memory
                if not self._try_capture(b):
                    self._seen[b] = -1  # not tried again

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets captured so far."""
        return tuple(sorted(self._graphs))

    def _try_capture(self, b: int) -> bool:
        try:
            self._capture(b)
            return True
        except Exception as e:
            log.warning("CUDA graph capture failed for prefill bucket %d (it runs eager): %s", b, e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return False

    def _padding(self, t: int) -> torch.Tensor:
        """A host input of ``t`` padding tokens and ``max_seqs`` last-token indices of 0."""
        flat = torch.zeros(5 * t + self.max_seqs, dtype=torch.long)
        flat[3 * t: 4 * t] = self.scratch_row
        return flat

    def _capture(self, t: int) -> None:
        static = self._padding(t).to(self.device)
        logits = torch.empty(self.max_seqs, self.executor.head.shape[0], dtype=torch.float32, device=self.device)
        inp, last = static[: 5 * t].view(5, t), static[5 * t:]
        graph, _ = self.pool.capture(lambda: logits.copy_(self.executor.prefill_from(inp, last)))
        self._graphs[t] = (graph, static, logits)

    def warm(self) -> None:
        """Run the smallest and the largest bucket's padding eagerly (nothing captured): between
        them every tile set a prefill takes (the decode phase widens its tiles from a few hundred
        tokens), so their kernels are loaded before the first request."""
        for t in sorted({self._planned[0], self._planned[-1]}):
            static = self._padding(t).to(self.device)
            self.executor.prefill_from(static[: 5 * t].view(5, t), static[5 * t:])

    def run(self, inp: torch.Tensor, last: list[int]) -> torch.Tensor:
        """Logits [len(last), Vp] of the prefill ``inp`` (a host [5, T] tensor): from the
        smallest bucket that holds it, else eager from the same inputs."""
        t = inp.shape[1]
        want = next((b for b in self._planned if b >= t), None)
        if want is not None and want not in self._graphs and self._seen.get(want, 0) >= 0 and len(last) <= self.max_seqs:
            uses = self._seen[want] = self._seen.get(want, 0) + 1
            if uses >= 2:  # lazy: captured at its second use (its padding warms it up first)
                self._seen[want] = 0 if self._try_capture(want) else -1
        bucket = next((b for b in sorted(self._graphs) if b >= t), None)
        if bucket is None or len(last) > self.max_seqs:
            self.eager += 1
            return self.executor.prefill_from(h2d(inp, device=self.device), h2d(last, torch.long, self.device))
        graph, static, logits = self._graphs[bucket]
        flat = self._padding(bucket)
        flat[: 5 * bucket].view(5, bucket)[:, :t] = inp
        flat[5 * bucket: 5 * bucket + len(last)] = torch.tensor(last, dtype=torch.long)
        copy_in(static, flat)
        graph.replay()
        self.replays += 1
        return logits[: len(last)]
