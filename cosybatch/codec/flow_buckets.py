"""Flow graph buckets: the sizes a packed solve is padded to, and the bounded set of them a run
can use (design.md D16, D27). Pure: no tensors, no model.

A bucket is what one captured Euler step fixes: tokens per CFG branch (``stride``, rounded up
geometrically), jobs (a power of two), the conv margin and trajectory records (per job), the conv
layout's length, and each attention launch's sub-sequence count and query bound. With a backend
whose padding costs only empty programs (``coarse``: the Triton attention, whose padded tiles
exit at once), every size follows from ``(stride, jobs, launches)``:

* the self launch's sub-sequence count and query bound come from ``(stride, jobs)`` like the pool
  launch's, instead of from the solve's own rows (final hops' lengths and counts made most of the
  keys a streaming run met);
* ``jobs`` is at least ``stride / JOB_TOKENS`` (a power of two): a padded job costs only conv
  frames (its gap and margin, ~2.4 % of a transformer token each), so this adds at most ~2 % of a
  step's work and takes the (large stride, few jobs) buckets out of the set;
* in streaming with a prefix arena both launches are always there (one merged launch): a solve of
  first hops only then pays an empty self part, one of final hops only the K/V writes of its
  tokens into the arena's dump frame; the launch flags no longer multiply the keys.

``keys`` enumerates every bucket up to a stride: with the flags above, at most a few hundred.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tokens per branch that one job bucket level covers: jobs >= pow2(ceil(stride / JOB_TOKENS)).
JOB_TOKENS = 256


def geometric(n: int, quantum: int = 64) -> int:
    """n rounded up to the next of quantum * 2**(k/4): buckets at most ~19 % larger than n."""
    if n <= quantum:
        return quantum
    k = math.ceil(4 * math.log2(n / quantum) - 1e-9)
    return int(math.ceil(quantum * 2 ** (k / 4) / quantum) * quantum)


def pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class Geometry:
    """What a runner's buckets depend on besides the solve: the attention chunk (frames), the
    conv gap and margin (frames), the most jobs a solve holds, and whether sizes are coarse."""

    chunk: int
    conv_gap: int
    conv_margin: int
    max_jobs: int
    coarse: bool = True

    @property
    def jobs_cap(self) -> int:
        return pow2(self.max_jobs)


def sizes(g: Geometry, job_tokens: int, n_jobs: int, pool: bool, self_: bool, self_count: int = 0,
          self_max_q: int = 0) -> dict:
    """A bucket's sizes for a solve of ``n_jobs`` jobs and ``job_tokens`` tokens per branch.
    ``pool``/``self_``: whether each attention launch is there; ``self_count``, ``self_max_q``:
    the self launch's real sub-sequences and longest one (read only when not ``g.coarse``)."""
    stride = geometric(job_tokens)
    jobs = pow2(n_jobs)
    if g.coarse:
        jobs = max(jobs, min(g.jobs_cap, pow2(-(-stride // JOB_TOKENS))))
    margin = jobs * g.conv_margin  # a cached job's margin and records are < conv_margin frames
    # Sub-sequences of either launch: per CFG twin of a job at most new / chunk + 1 (chunk-causal
    # rows; a full-attention row is one), so at most 2 (stride / chunk + 1 + jobs), plus a dummy
    # per gap. A function of (stride, jobs), so it adds no bucket of its own (buckets that
    # multiplied with every launch's own counts were captured ~500 times in a 1,088-row run).
    seqs = 4 * (stride // g.chunk + 1 + jobs) + 1
    if g.coarse:
        self_seqs, self_q = (seqs, stride) if self_ else (0, 0)
    else:
        self_seqs = pow2(2 * self_count + 1, 4) if self_ else 0
        self_q = pow2(self_max_q, 64) if self_ else 0
    return {"stride": stride, "jobs": jobs, "margin": margin, "records": margin,
            "conv_len": 2 * (jobs * g.conv_gap + stride + margin) + 1,
            "pool_seqs": seqs if pool else 0, "self_seqs": self_seqs, "self_max_q": self_q}


def key(s: dict) -> tuple:
    """The graph cache's key of a bucket's sizes."""
    return tuple(sorted(s.items()))


def strides(max_stride: int) -> dict[int, int]:
    """Every bucket stride for solves of at most ``max_stride`` tokens per branch, ascending, each
    with the fewest tokens that round to it (``geometric`` is not idempotent: 1,280 -> 1,472)."""
    out: dict[int, int] = {}
    for n in range(1, max_stride + 1):
        out.setdefault(geometric(n), n)
    return out


def launch_flags(streaming: bool, arena: bool, merges: bool = True) -> list[tuple[bool, bool]]:
    """The (pool, self) launch pairs a runner's solves can have: whole responses are all self;
    streaming hops with a prefix arena are cached (pool) except full-attention final hops and
    hops the arena has no room for (self). ``merges``: streaming buckets always carry both."""
    if not streaming or not arena:
        return [(False, True)]
    return [(True, True)] if merges else [(True, False), (False, True), (True, True)]


def keys(g: Geometry, max_stride: int, flags: list[tuple[bool, bool]], min_stride: int = 0) -> list[tuple]:
    """Every bucket key (coarse geometry) of solves of at most ``g.max_jobs`` jobs and at most
    ``max_stride`` (and at least ``min_stride``) tokens per branch, smallest first; ``flags``
    from ``launch_flags``."""
    if not g.coarse:
        raise ValueError("only a coarse geometry has a bounded bucket set")
    out = []
    for stride, tokens in strides(max_stride).items():
        if stride < geometric(min_stride):
            continue
        # a solve of this stride holds at most ``stride`` tokens, so at most that many jobs
        jobs = sorted({sizes(g, tokens, n, True, True)["jobs"] for n in _pow2_upto(min(g.max_jobs, stride))})
        for j in jobs:
            for pool, self_ in flags:
                out.append(key(sizes(g, tokens, j, pool, self_)))
    return out


def _pow2_upto(n: int) -> list[int]:
    out, j = [], 1
    while j < n:
        out.append(j)
        j *= 2
    return out + [n]
