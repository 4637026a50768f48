"""torchtitan_amp/tools/plan_layout.py: valid factorizations, the memory filter, and the ranking's sense."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from torchtitan_amp.config import load_config
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS
from torchtitan_amp.tools import plan_layout as pl
from torchtitan_amp.train import dry_run

EIGHT_B = ("--flavor", "llama3_8b", "--gpus", "8", "--seq-len", "8192")


@cache
def _evaluated() -> tuple[list, int]:
    """8B on 8 GPUs, evaluated once; the memory limit only filters."""
    return pl.candidates(pl.parse_args(list(EIGHT_B)))


def _plan(*argv: str) -> dict:
    assert argv[: len(EIGHT_B)] == EIGHT_B
    return pl.plan(pl.parse_args(list(argv)), _evaluated())


def test_factorizations_are_exactly_the_valid_layouts() -> None:
    for gpus in (1, 8, 12, 64):
        facts = pl.factorizations(gpus)
        assert len(facts) == len(set(facts))
        assert all(r * s * t * p * c == gpus for r, s, t, p, c in facts)
        n = [d for d in range(1, gpus + 1) if gpus % d == 0]  # any factor of a product divides it
        brute = {(r, s, t, p, c) for r in n for s in n for t in n for p in n for c in n if r * s * t * p * c == gpus}
        assert set(facts) == brute
    heads = LLAMA3_FLAVORS["llama3_8b"].n_heads
    kv = LLAMA3_FLAVORS["llama3_8b"].n_kv_heads
    # Every evaluated candidate: a plan lists neither fitting nor not fitting the CP layouts that
    # fit where nothing needs CP.
    cands = _evaluated()[0]
    seen = {c.degrees for c in cands}
    for r, s, t, p, c in seen:
        assert 8 % t == 0 and heads % t == 0 and kv % t == 0 and p <= 32
        assert not (r > 1 and s * c == 1 and t > 1), "DDP x TP is rejected by the trainer"
        assert 8192 // c >= 4096, "--min-cp-tokens"
    assert {(1, 8, 1, 1, 1), (8, 1, 1, 1, 1), (1, 1, 8, 1, 1), (1, 2, 2, 2, 1), (1, 4, 1, 1, 2)} <= seen
    assert (2, 1, 4, 1, 1) not in seen  # DDP x TP
    # Every printed override set is one the trainer accepts, with the same degrees.
    for c in cands[::17]:
        res = dry_run.resolve(load_config(c.overrides), 8)
        assert (res.dims.dp_replicate, res.dims.dp_shard, res.dims.tp, res.dims.pp, res.dims.cp) == c.degrees
        assert res.layout.ac_mode == c.layout.ac_mode


def test_candidate_embeds_the_memory_layout() -> None:
    """A candidate holds the memory model's Layout that the dry run resolved from its overrides and
    declares none of its fields again."""
    from dataclasses import fields

    from torchtitan_amp import memory

    assert not {f.name for f in fields(pl.Candidate)} & {f.name for f in fields(memory.Layout)}
    for c in _evaluated()[0][::41]:
        assert c.layout == dry_run.resolve(load_config(c.overrides + ["--dry_run.vocab_size", "128256"]), 8).layout
        assert c.degrees == (c.layout.dp_replicate, c.layout.dp_shard, c.layout.tp, c.layout.pp, c.layout.cp)


def test_tp_beyond_a_node_is_excluded() -> None:
    args = pl.parse_args([*EIGHT_B, "--gpus-per-node", "4"])
    assert not pl.structurally_valid((1, 1, 8, 1, 1), args, 32)
    assert pl.structurally_valid((1, 2, 4, 1, 1), args, 32)
    assert not pl.structurally_valid((1, 1, 1, 64, 1), args, 32)


def test_memory_filter() -> None:
    small = _plan(*EIGHT_B, "--gpu-mem-gib", "40")
    assert small["fitting"] and small["not_fitting"]
    assert all(c.memory_gib <= 40 * 0.9 for c in small["fitting"])
    assert all(c.memory_gib > 40 * 0.9 for c in small["not_fitting"])
    # DDP holds the whole model's state (16 bytes/param, ~112 GiB): never fits in 40 GiB.
    assert not any(c.degrees == (8, 1, 1, 1, 1) for c in small["fitting"])
    tiny = pl.plan(pl.parse_args([*EIGHT_B, "--gpu-mem-gib", "4"]))  # a full run, not re-filtered
    assert not tiny["fitting"] and len(tiny["not_fitting"]) == len(_evaluated()[0])
    # What fits in 40 GiB without needing CP is listed; CP layouts that fit too are left out.
    unlisted = len(_evaluated()[0]) - len(small["fitting"]) - len(small["not_fitting"])
    assert unlisted == sum(c.fits and c.layout.cp > 1 for c in _evaluated()[0])
    assert "nothing fits" in pl.format_plan(tiny, 5)


def test_ranking_8b_on_8_gpus_picks_fsdp_8() -> None:
    result = _plan(*EIGHT_B, "--gpu-mem-gib", "141")
    best = result["fitting"][0]
    assert best.degrees == (1, 8, 1, 1, 1) and best.layout.ac_mode == "none" and best.precision.startswith("bf16")
    keys = [pl.rank_key(c) for c in result["fitting"]]
    assert keys == sorted(keys)
    assert all(c.step_s >= best.step_s / 1.01 for c in result["fitting"])
    # fp32 compute is slower than bf16 for the same layout; bf16 reduce never sends more.
    same = {(c.precision, c.layout.ac_mode): c for c in result["fitting"] if c.degrees == (1, 8, 1, 1, 1)}
    assert same[("fp32", "full")].step_s > same[("bf16/fp32-reduce", "full")].step_s
    assert same[("bf16/bf16-reduce", "none")].dp_comm_s < same[("bf16/fp32-reduce", "none")].dp_comm_s


def test_more_memory_allows_less_activation_checkpointing() -> None:
    def best_fsdp8(mem: str) -> str:
        result = _plan(*EIGHT_B, "--gpu-mem-gib", mem)
        return next(c for c in result["fitting"] if c.degrees == (1, 8, 1, 1, 1)).layout.ac_mode

    assert best_fsdp8("80") == "full"
    assert best_fsdp8("141") == "none"
    # And AC costs time: the same layout is faster without it.
    result = _plan(*EIGHT_B, "--gpu-mem-gib", "141")
    by_ac = {
        c.layout.ac_mode: c
        for c in result["fitting"]
        if c.degrees == (1, 8, 1, 1, 1) and c.precision == "bf16/fp32-reduce"
    }
    assert by_ac["full"].compute_s > by_ac["none"].compute_s


def test_pipeline_bubble_and_bandwidth() -> None:
    args = pl.parse_args([*EIGHT_B, "--gpu-mem-gib", "1000"])
    result = _plan(*EIGHT_B, "--gpu-mem-gib", "1000")
    pp = [c for c in result["fitting"] if c.layout.pp > 1]
    assert pp
    for c in pp:
        assert c.bubble_s == pytest.approx(c.compute_s * (c.layout.pp - 1) / c.layout.microbatches)
    # Groups that leave the node use the inter-node bandwidth (mesh: pp, dp_replicate, dp_shard, tp).
    assert pl._group_bandwidth("tp", (1, 8, 8, 1, 1), args) == 450e9
    assert pl._group_bandwidth("dp_shard", (1, 8, 8, 1, 1), args) == 50e9
    assert pl._group_bandwidth("dp_shard", (1, 2, 4, 1, 1), args) == 450e9
    assert pl._group_bandwidth("dp_replicate", (2, 2, 4, 1, 1), args) == 50e9
    # cp sits between dp_shard and tp; FSDP's group spans dp_shard x cp.
    assert pl._group_bandwidth("cp", (1, 8, 1, 1, 8), args) == 450e9
    assert pl._group_bandwidth("dp_shard", (1, 2, 1, 1, 4), args) == 450e9
    assert pl._group_bandwidth("dp_shard", (1, 2, 2, 1, 4), args) == 50e9


def test_cli_prints_overrides_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert pl.main([*EIGHT_B, "--gpu-mem-gib", "80", "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "#1: --model.flavor llama3_8b" in text and "--parallelism.data_parallel_shard_degree" in text
    data = json.loads(out.read_text())
    assert len(data["fitting"]) >= 3
    assert data["fitting"][0]["step_s"] <= 1.01 * min(c["step_s"] for c in data["fitting"])
    assert pl.main(["--flavor", "nope", "--gpus", "8"]) == 2


def test_context_parallel_only_when_the_sequence_needs_it() -> None:
    # 8B at 8192 on 8 GPUs fits without CP: none is proposed, though CP 2 layouts were evaluated.
    result = _plan(*EIGHT_B, "--gpu-mem-gib", "80")
    assert not result["needs_cp"] and all(c.layout.cp == 1 for c in result["fitting"])
    assert any(c.layout.cp == 2 for c in result["not_fitting"] + _evaluated()[0])
    # 524288 tokens: one sequence's activations fit no FSDP / TP / PP split of 64 80 GiB GPUs (at
    # 131072, TP 4 with full AC still does); context parallel is what makes it fit.
    args = pl.parse_args(
        [
            "--flavor",
            "llama3_8b",
            "--gpus",
            "64",
            "--seq-len",
            "524288",
            "--gpu-mem-gib",
            "80",
            "--top",
            "3",
            "--min-cp-tokens",
            "16384",
        ]
    )
    long = pl.plan(args)
    assert long["needs_cp"] and long["fitting"] and all(c.layout.cp > 1 for c in long["fitting"])
    best = long["fitting"][0]
    assert best.cp_comm_s > 0 and "CP" in best.describe()
    assert "--parallelism.context_parallel_degree" in " ".join(best.overrides)
    assert "context parallel needed" in pl.format_plan(long, 3)


def test_expert_parallel_proposed_for_qwen3_moe() -> None:
    """An MoE model's layouts split dp_shard x cp further by EP (degrees dividing the routed
    experts; with TP too, the experts replicated over tp); the memory model sizes them, and for
    Qwen3-30B-A3B on 16 GPUs EP beats FSDP alone: its expert all-gathers go over the efsdp ranks,
    its all-to-alls stay in a node."""
    assert pl.expert_splits((1, 8, 1, 1, 2), 128) == [1, 2, 4, 8, 16]
    assert pl.expert_splits((1, 8, 1, 1, 1), 6) == [1, 2]
    assert pl.expert_splits((1, 4, 2, 1, 1), 128) == [1, 2, 4] and pl.expert_splits((1, 8, 1, 1, 1), 0) == [1]
    args = pl.parse_args(
        [
            "--model",
            "moe",
            "--flavor",
            "qwen3_30b_a3b",
            "--gpus",
            "16",
            "--seq-len",
            "4096",
            "--vocab-size",
            "151936",
            "--gpu-mem-gib",
            "80",
            "--top",
            "3",
        ]
    )
    result = pl.plan(args)
    cands = result["fitting"] + result["not_fitting"]
    assert {c.layout.ep for c in cands} == {1, 2, 4, 8, 16}
    # EP x TP proposed: at most dp_shard = 8 with TP 2
    assert {c.layout.ep for c in cands if c.layout.tp > 1} == {1, 2, 4, 8}
    best = result["fitting"][0]
    assert best.layout.ep > 1 and best.ep_comm_s > 0 and f"EP {best.layout.ep}" in best.describe(), pl.format_plan(
        result, 5
    )
    assert f"--parallelism.expert_parallel_degree {best.layout.ep}" in " ".join(best.overrides)
    res = dry_run.resolve(load_config(best.overrides + ["--dry_run.vocab_size", "151936"]), 16)
    assert res.dims.ep == best.layout.ep and res.layout.ep == best.layout.ep
    # FLOPs of the active experts only: the step's compute is well under a dense 30B model's.
    dense_flops = 6 * (res.model_dims.total_params() - 151936 * 2048) * 16 * 4096
    full_ac = 4 / 3 if best.layout.ac_mode == "full" else 1
    assert best.compute_s < 0.2 * dense_flops / 16 / (0.4 * 989e12) * full_ac


def test_replica_groups_plan_one_group_and_price_the_cross_group_allreduce() -> None:
    """8B on 16 GPUs as 2 torchft replica groups of 8: each group's layouts are those the trainer
    allows under fault tolerance (FSDP 8), with the job's global batch split between the groups,
    and each rank all-reduces its gradient shard across the groups: params / 8 in the reduce dtype,
    priced between nodes on top of the same group's FSDP traffic."""
    args = pl.parse_args(["--flavor", "llama3_8b", "--gpus", "16", "--seq-len", "8192", "--replica-groups", "2"])
    result = pl.plan(args)
    cands = result["fitting"]
    assert {(c.precision, c.layout.ac_mode) for c in cands} >= {("fp32", "full"), ("bf16/bf16-reduce", "full")}
    assert all(c.degrees == (1, 8, 1, 1, 1) and c.layout.replica_groups == 2 for c in cands)
    assert cands[0].describe() == "FT 2 x FSDP 8"
    # One 8-GPU job's FSDP 8 candidates: the same per-rank batch and group traffic.
    plain = {(c.precision, c.layout.ac_mode): c for c in _evaluated()[0] if c.degrees == (1, 8, 1, 1, 1)}
    n = 8_030_261_248  # Llama 3 8B's parameters
    for c in cands:
        res = dry_run.resolve(load_config(c.overrides), 8)
        assert res.layout.replica_groups == 2 and res.layout.grad_accum == 1
        shard_bytes = sum(c.ft_allreduce_bytes.values())
        # Every parameter's shard once (FSDP pads dim 0 to a multiple of 8: a little more).
        elements = c.ft_allreduce_bytes.get("float32", 0) / 4 + c.ft_allreduce_bytes.get("bfloat16", 0) / 2
        assert elements == pytest.approx(n / 8, rel=1e-3)
        if c.precision == "fp32":
            assert set(c.ft_allreduce_bytes) == {"float32"}
        if c.precision == "bf16/bf16-reduce":  # bf16 but for what the plan keeps in fp32
            assert c.ft_allreduce_bytes["bfloat16"] > 0.85 * n / 8 * 2
        # An all-reduce over 2 groups moves 2 x (2 - 1) / 2 of the bytes, at 50 GB/s between nodes.
        extra = c.dp_comm_s - plain[(c.precision, c.layout.ac_mode)].dp_comm_s
        assert extra == pytest.approx(shard_bytes / 50e9, rel=1e-9)
    assert "2 torchft replica groups of 8 GPUs" in pl.format_plan(result, 3)
    with pytest.raises(SystemExit):
        pl.parse_args(["--flavor", "llama3_8b", "--gpus", "16", "--replica-groups", "3"])


# Each family's largest flavor at the GPU count docs/scaling.md shows, searched over the degrees of
# that table's best layout only (the whole search takes minutes at 256 GPUs; its ranking is what the
# tests above check): a proposal fits the GPU (90% of it) with the family's terms sized.
FAMILY_PLANS = {
    "qwen3": ("qwen3_32b", 32, 80, (1, 2, 8, 2, 1), "151936"),
    "deepseek_v3": ("deepseek_v3_671b", 256, 80, (1, 256, 1, 1, 1), "129280"),
    # With its prediction depth under TP and on the last stage: the table's H200 FSDP 4 x TP 2 x PP 32.
    "deepseek_v3 h200": ("deepseek_v3_671b", 256, 141, (1, 4, 2, 32, 1), "129280"),
    # Without the depth that pipelined layout fits on H100s too.
    "deepseek_v3 no_mtp": ("deepseek_v3_671b_no_mtp", 256, 80, (1, 4, 2, 32, 1), "129280"),
    "gpt_oss": ("gpt_oss_120b", 32, 141, (1, 16, 1, 2, 1), "201088"),
}


@pytest.mark.parametrize("family", list(FAMILY_PLANS))
def test_largest_flavor_of_each_family_gets_a_layout_that_fits(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout is proposed, its estimate fits (sized with the flavor's own vocabulary, as with
    --vocab-size given), and its overrides resolve to the same layout in the trainer's dry run; the
    MoE families' proposals split the experts (EP > 1), and gpt-oss's all checkpoint every block (a
    block's fp32 S x S sink scores, 8 H (S + 1) bytes per token, are 8.6 GB a sequence)."""
    flavor, gpus, mem, degrees, vocab = FAMILY_PLANS[family]
    family = family.split()[0]
    monkeypatch.setattr(pl, "factorizations", lambda n: [degrees])
    argv = ["--model", family, "--flavor", flavor, "--gpus", str(gpus), "--seq-len", "4096", "--gpu-mem-gib", str(mem)]
    result = pl.plan(pl.parse_args(argv))  # the flavor's vocabulary unless --vocab-size says otherwise
    best = result["fitting"][0]
    given = pl.plan(pl.parse_args([*argv, "--vocab-size", vocab]))["fitting"][0]
    assert (given.overrides, given.memory_gib) == (best.overrides, best.memory_gib)
    assert best.memory_gib <= mem * 0.9, pl.format_plan(result, 3)
    assert (best.layout.ep > 1) == (family != "qwen3")
    res = dry_run.resolve(load_config(best.overrides + ["--dry_run.vocab_size", vocab]), gpus)
    assert (res.layout.dp_shard, res.layout.tp, res.layout.pp, res.layout.ep) == (
        best.layout.dp_shard,
        best.layout.tp,
        best.layout.pp,
        best.layout.ep,
    )
    if family == "gpt_oss":
        assert {c.layout.ac_mode for c in result["fitting"]} == {"full"}
