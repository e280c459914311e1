"""Where a hybrid model's state checkpoints sit. How far apart the periodic ones are:
`--state-checkpoint-every auto` (the default) picks the spacing from the model's bytes, so the checkpoints
of a long prompt cost a bounded share of the K/V they sit between; each moves to the nearest line start
(`snap_to_line`); and which of its states a request keeps when room is short (`most_useful`).

    prompt  |-- N blocks of K/V --|x|-- N blocks of K/V --|x| ...     x = one checkpoint (the recurrent state)
    cost(x) <= AUTO_SHARE * N * kv_bytes_per_block   =>   N = max(1, ceil(cost(x) / (AUTO_SHARE * kv_bytes_per_block)))

cost(x) is what a checkpoint takes in its tier: `units` whole block slots (scheduler/cache/checkpoints.py), i.e.
its state bytes rounded up to blocks. On a real model that is the state's bytes within one block; on the tiny
test models, whose states are a fraction of a block, it is the block slot, since that is what it crowds out.

Why AUTO_SHARE = 1/2: a request that branches far from every other checkpoint (message starts, prompt and
reply ends, branch points) recomputes up to N blocks, N/2 on average, and N grows as 1 / share; the states'
memory grows as share. At 1/2 periodic states take at most a third of a long prompt's cached bytes (the K/V
keeps two thirds), and a branch costs at most 2 x units blocks of recompute. 1/4 (N=12 on tiny-qwen3next)
measured worse (toggling tool list 1.12 with a full re-read, docs/BENCHMARKS.md). Examples (f16 K/V unless
said, 16-token blocks):

    model               state / checkpoint          K/V block   units   N (blocks)   tokens
    tiny-lfm2 (f32)     1.5 KiB (3 conv x 2 x 64)   8 KiB       1       2            32
    tiny-qwen3next (f32) 16.5 KiB                   8 KiB       3       6            96
    tiny-qwen3next      16.5 KiB                   4 KiB       5       10           160  (scripts/bench_cache.py)
    LFM2-1.2B           160 KiB (10 conv layers)    192 KiB     1       2            32
    Qwen3-Next-80B-A3B  75.4 MiB (36 DeltaNet)      384 KiB     201     402          6432

A window model (lfm2, engine/state_window.py) recomputes a lost state from W tokens whatever N is, so N
matters little there; a DeltaNet model (qwen3next) has only checkpoints.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from fractions import Fraction

AUTO = "auto"
AUTO_SHARE = Fraction(1, 2)  # the most a checkpoint may cost, as a share of the K/V between two of them


def auto_every_blocks(state_bytes: int, block_bytes: int, share: Fraction = AUTO_SHARE) -> int:
    """The auto spacing in K/V blocks for a checkpoint of `state_bytes` (real bytes) beside K/V blocks of
    `block_bytes` at the configured --kv-type: the state counted as the whole block slots it takes."""
    assert state_bytes > 0 and block_bytes > 0 and 0 < share <= 1, (state_bytes, block_bytes, share)
    cost_bytes = math.ceil(state_bytes / block_bytes) * block_bytes  # units x block (exact integers)
    return max(1, math.ceil(Fraction(cost_bytes) / (share * block_bytes)))


@dataclass(frozen=True)
class CheckpointSpacing:
    """The spacing in effect and why (for the start-up log line)."""

    every_blocks: int  # 0: no periodic checkpoints
    requested: str  # "auto" or the integer given
    state_bytes: int
    block_bytes: int
    block_tokens: int

    def describe(self) -> str:
        units = math.ceil(self.state_bytes / self.block_bytes)
        sizes = (f"a checkpoint is {self.state_bytes} bytes of recurrent state = {units} K/V block slots of "
                 f"{self.block_bytes} bytes")
        if self.every_blocks == 0:
            return f"checkpoints of the recurrent state: none periodic (--state-checkpoint-every 0); {sizes}"
        tokens = self.every_blocks * self.block_tokens
        why = (f"auto: states at most {float(AUTO_SHARE):g} of the K/V between them" if self.requested == AUTO
               else f"--state-checkpoint-every {self.requested}")
        share = units / self.every_blocks
        return (f"checkpoints of the recurrent state: every {self.every_blocks} blocks ({tokens} tokens; {why}); {sizes}, "
                f"so periodic states cost {share:.2f} x the K/V they sit between")


def resolve_spacing(requested: int | str | None, state_bytes: int, block_bytes: int,
                    block_tokens: int) -> CheckpointSpacing:
    """--state-checkpoint-every resolved for a model: None or "auto" by the byte rule, an integer as given."""
    if requested is None or requested == AUTO:
        return CheckpointSpacing(auto_every_blocks(state_bytes, block_bytes), AUTO, state_bytes, block_bytes,
                                 block_tokens)
    every = int(requested)
    assert every >= 0, f"--state-checkpoint-every {every}"
    return CheckpointSpacing(every, str(every), state_bytes, block_bytes, block_tokens)


def snap_to_line(position: int, step: int, line_starts: tuple[int, ...], end: int) -> int:
    """The line start nearest `position` within half a period either way (the earlier on a tie; below
    `end`), else position itself. Nearest, not the last before: a checkpoint that catches no branch is
    then on average where it was. Whether s is chosen depends only on tokens before s, so prompts that
    share a prefix keep their checkpoints at the same places in it."""
    i = bisect_right(line_starts, position)
    near = [s for s in line_starts[max(0, i - 1) : i + 1] if abs(s - position) < step / 2 and 0 < s < end]
    return min(near, key=lambda s: (abs(s - position), s)) if near else position


def most_useful(positions, start: int, branch_points) -> list[int]:
    """A request's checkpoint positions, the most useful first: the order in which they are given up when
    room is short is the reverse. The least useful is the one whose loss costs least recompute, the
    smallest gap to the one before it (or to `start`, where the request's own computation began), periodic
    ones before branch points (`branch_points`: where a message begins, the prompt ends or it left a
    cached sequence), the earlier on a tie; gaps are counted again after each one goes. Under pressure
    this keeps a trimmed history's system-message boundary rather than three states a few tokens apart."""
    kept, given_up = sorted(positions), []
    while kept:
        i = min(range(len(kept)), key=lambda j: (kept[j] in branch_points, kept[j] - (kept[j - 1] if j else start),
                                                 kept[j]))
        given_up.append(kept.pop(i))
    return given_up[::-1]
