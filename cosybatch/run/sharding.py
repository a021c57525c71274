"""Splitting a manifest across processes or machines.

Every shard parses the whole manifest and computes the same assignment, so no
coordination is needed; the split balances estimated cost rather than row count
because one long paragraph can cost as much as twenty short sentences.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from cosybatch.manifest import ManifestRow

# Rough English speaking rate, only to put text length on the same scale as prompt seconds.
CHARS_PER_SECOND = 15.0


class ShardError(ValueError):
    pass


@dataclass(frozen=True)
class Shard:
    index: int  # 0-based
    count: int
    # Set by the multi-process launcher (cosybatch.run.multi.launcher), which splits only the rows still
    # to do: then these utt_ids are the shard, instead of this index's share of the manifest.
    members: frozenset[str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ShardError(f"shard {self.index}/{self.count}: need 0 <= i < n and n >= 1")

    @property
    def tag(self) -> str:
        """File-name suffix for this shard's ledger/timing ('' when unsharded)."""
        return "" if self.count == 1 else f".shard-{self.index}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


ALL = Shard(0, 1)


def parse_shard(spec: str) -> Shard:
    parts = spec.strip().split("/")
    if len(parts) != 2:
        raise ShardError(f"--shard {spec!r}: expected i/n, e.g. 0/4 (0-based index)")
    try:
        i, n = int(parts[0]), int(parts[1])
    except ValueError:
        raise ShardError(f"--shard {spec!r}: i and n must be integers") from None
    try:
        return Shard(i, n)
    except ShardError as e:
        raise ShardError(f"--shard {spec!r}: {e}") from None


def shard_from_env(env: Mapping[str, str] | None = None) -> tuple[Shard, str]:
    """The shard implied by torchrun or a Slurm job array, and where it came from."""
    env = os.environ if env is None else env
    try:
        if "WORLD_SIZE" in env and "RANK" in env:
            return Shard(int(env["RANK"]), int(env["WORLD_SIZE"])), "RANK/WORLD_SIZE"
        if "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_ID" in env:
            task = int(env["SLURM_ARRAY_TASK_ID"])
            lo = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            step = int(env.get("SLURM_ARRAY_TASK_STEP", "1")) or 1
            return (Shard((task - lo) // step, int(env["SLURM_ARRAY_TASK_COUNT"])),
                    "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
    except ValueError as e:
        raise ShardError(f"cannot derive the shard from the environment: {e}") from None
    return ALL, "default"


def estimated_cost(row: ManifestRow) -> float:
    """Seconds-ish: the flow pays for prompt frames and generated frames alike."""
    return row.prompt_s + len(row.target_text) / CHARS_PER_SECOND


def assign(rows: Sequence[ManifestRow], count: int) -> list[int]:
    """Shard index per row: greedy longest-first onto the least-loaded shard.

    Ties are broken by utt_id and shard index, so the result depends only on the rows.
    """
    if count == 1:
        return [0] * len(rows)
    order = sorted(range(len(rows)), key=lambda k: (-estimated_cost(rows[k]), rows[k].utt_id))
    loads = [(0.0, s) for s in range(count)]
    heapq.heapify(loads)
    out = [0] * len(rows)
    for k in order:
        load, s = heapq.heappop(loads)
        out[k] = s
        heapq.heappush(loads, (load + estimated_cost(rows[k]), s))
    return out


def balance(rows: Sequence[ManifestRow], count: int, done: Collection[str] = ()) -> list[list[ManifestRow]]:
    """The rows not in ``done`` split into ``count`` lists of about equal estimated cost.

    Balancing the rows still to do (not the whole manifest) is what keeps every worker busy
    on a resume, when the rows left are whatever an earlier run did not reach.
    """
    todo = [r for r in rows if r.utt_id not in done]
    parts: list[list[ManifestRow]] = [[] for _ in range(count)]
    for row, owner in zip(todo, assign(todo, count)):
        parts[owner].append(row)
    return parts


def select(rows: Sequence[ManifestRow], shard: Shard) -> list[ManifestRow]:
    """This shard's rows, in manifest order."""
    if shard.members is not None:
        return [r for r in rows if r.utt_id in shard.members]
    if shard.count == 1:
        return list(rows)
    owners = assign(rows, shard.count)
    return [r for r, o in zip(rows, owners) if o == shard.index]
