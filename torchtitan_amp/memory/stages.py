"""Pipeline stages of one rank and the passes of a schedule step: which layers each stage holds,
the order of its forward and backward passes, and the microbatches whose activations it holds at
its peak."""

from __future__ import annotations

import math

from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.specs import Layout, Stage
from torchtitan_amp.rules import STAGES_PER_RANK, stage_layer_ranges


def rank_stages(model: ModelDims, layout: Layout, pp_rank: int = 0) -> list[Stage]:
    ranges = stage_layer_ranges(model.n_layers, layout.num_stages, layout.split_points)
    n = layout.num_stages
    return [Stage(s, ranges[s], s == 0, s == n - 1) for s in layout.stage_ids(pp_rank)]


def schedule_ops(schedule: str, n_microbatches: int, num_stages: int, stage: int) -> list[str]:
    """Order of forward (F) and backward (B) microbatch passes of one stage in a step: GPipe runs
    every forward then every backward; 1F1B runs min(M, stages - stage) forwards, then
    alternates B and F, then the remaining Bs (torch.distributed.pipelining.Schedule1F1B)."""
    m = n_microbatches
    if schedule == "GPipe":
        return ["F"] * m + ["B"] * m
    warmup = min(m, num_stages - stage)
    ops = ["F"] * warmup
    for _ in range(m - warmup):
        ops += ["B", "F"]
    return ops + ["B"] * warmup


def in_flight_microbatches(layout: Layout, stage: int, pp_rank: int) -> int:
    """Microbatches whose activations a stage holds at its peak: 1F1B's warm-up depth, every
    microbatch under GPipe; Interleaved1F1B per torch's warm-up count (forward chunks over this
    rank's stages before the first backward), spread evenly over its stages."""
    if layout.pp == 1:
        return 1
    m = layout.microbatches
    if layout.pp_schedule == "GPipe":
        return m
    if layout.pp_schedule == "1F1B":
        return min(m, layout.num_stages - stage)
    v = STAGES_PER_RANK[layout.pp_schedule]
    warmup = min((v - 1) * layout.pp + 2 * (layout.pp - 1 - pp_rank), m * v)
    return max(1, math.ceil((warmup + 1) / v))


def stage_ops(layout: Layout, stage: Stage) -> list[str]:
    """Forward/backward passes of a stage in one schedule step (["F", "B"] without PP)."""
    if layout.pp == 1:
        return ["F", "B"]
    return schedule_ops(layout.pp_schedule, layout.microbatches, layout.num_stages, stage.index)
