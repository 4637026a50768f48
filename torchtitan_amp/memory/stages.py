"""Pipeline stages of one rank and the passes of a schedule step: which layers each stage holds,
the order of its forward and backward passes, and the microbatches whose activations it holds at
its peak."""

from __future__ import annotations

from torchtitan_amp.core.rules import STAGES_PER_RANK, stage_layer_ranges
from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.specs import Layout, Stage


def rank_stages(model: ModelDims, layout: Layout, pp_rank: int = 0) -> list[Stage]:
    """The pipeline stages one rank holds (one per rank, or several under an interleaved schedule),
    each with its layers and whether it is the first or last of the model.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank, from 0.
    """
    ranges = stage_layer_ranges(model.n_layers, layout.num_stages, layout.split_points)
    n = layout.num_stages
    return [Stage(s, ranges[s], s == 0, s == n - 1) for s in layout.stage_ids(pp_rank)]


def schedule_ops(schedule: str, n_microbatches: int, num_stages: int, stage: int) -> list[str]:
    """Order of forward (F) and backward (B) microbatch passes of one stage in a step: GPipe runs
    every forward then every backward; 1F1B runs min(M, stages - stage) forwards, then
    alternates B and F, then the remaining Bs (torch.distributed.pipelining.Schedule1F1B).

    Args:
        schedule: the pipeline schedule ("GPipe" or "1F1B").
        n_microbatches: microbatches per step (M).
        num_stages: stages of the pipeline.
        stage: this stage's index, from 0.
    """
    m = n_microbatches
    if schedule == "GPipe":
        return ["F"] * m + ["B"] * m
    warmup = min(m, num_stages - stage)
    ops = ["F"] * warmup
    for _ in range(m - warmup):
        ops += ["B", "F"]
    return ops + ["B"] * warmup


def interleaved_order(pp: int, n_microbatches: int, stages_per_rank: int, pp_rank: int) -> list[tuple[int, str]]:
    """(stage, F|B) passes of one rank under Interleaved1F1B, in torch's order
    (ScheduleInterleaved1F1B: rounds of pp microbatches, a warm-up of (v - 1) x per-round + 2 x
    (pp - 1 - rank) forwards, then one forward and one backward per slot, then the backwards).

    Args:
        pp: the pipeline degree (ranks).
        n_microbatches: microbatches per step.
        stages_per_rank: the virtual stages each rank holds (v).
        pp_rank: this rank, from 0.
    """
    m, v = n_microbatches, stages_per_rank
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), m * v)

    def fwd(op: int) -> int:
        return ((op // per_round) % v) * pp + pp_rank

    def bwd(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + pp_rank

    order = [(fwd(op), "F") for op in range(warmup)]
    for op in range(warmup, m * v):
        order += [(fwd(op), "F"), (bwd(op), "B")]
    return order + [(bwd(op), "B") for op in range(m * v, m * v + warmup)]


def rank_order(layout: Layout, pp_rank: int) -> list[tuple[int, str]]:
    """(stage, F|B) passes of one pipeline rank in a schedule step, in the schedule's order."""
    if layout.pp == 1:
        return [(0, "F"), (0, "B")]
    v = STAGES_PER_RANK[layout.pp_schedule]
    if v > 1:
        return interleaved_order(layout.pp, layout.microbatches, v, pp_rank)
    ops = schedule_ops(layout.pp_schedule, layout.microbatches, layout.num_stages, pp_rank)
    return [(pp_rank, op) for op in ops]


def in_flight_at_peak(layout: Layout, pp_rank: int, weights: dict[int, float]) -> dict[int, int]:
    """Microbatches forwarded and not yet backwarded, per stage of this rank, at the moment of the
    step when sum(held x weights[stage]) is largest (weights: a microbatch's saved bytes on each
    stage). Measured equal in real runs (tests/workers/pp_held.py). 1F1B: the warm-up depth
    min(m, stages - stage); GPipe: m; Interleaved1F1B: the first stage's chunk holds up to its
    warm-up forwards while the later chunks start to drain.

    Args:
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank, from 0.
        weights: a microbatch's saved bytes on each stage of this rank, by stage index.
    """
    held: dict[int, int] = {s: 0 for s in weights}
    best, best_bytes = dict(held), -1.0
    for stage, op in rank_order(layout, pp_rank):
        held[stage] += 1 if op == "F" else -1
        now = sum(held[s] * w for s, w in weights.items())
        if now > best_bytes:
            best, best_bytes = dict(held), now
    return best


def in_flight_microbatches(layout: Layout, stage: int, pp_rank: int) -> int:
    """The most microbatches one stage holds at once in a step (1 without PP).

    Args:
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        stage: the stage's index in the whole pipeline.
        pp_rank: the rank holding it.
    """
    held = most = 0
    for s, op in rank_order(layout, pp_rank):
        if s == stage:
            held += 1 if op == "F" else -1
            most = max(most, held)
    return max(most, 1)


def stage_ops(layout: Layout, stage: Stage) -> list[str]:
    """Forward/backward passes of a stage in one schedule step (["F", "B"] without PP)."""
    return [op for s, op in rank_order(layout, layout.stage_rank(stage.index)) if s == stage.index]
