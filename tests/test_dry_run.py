"""The fake-backend dry run (torchtitan_amp/train/dry_run.py) and the analytic model behind it
(torchtitan_amp/memory/), checked against what real runs hold and send.

- Real runs on 1, 2 and 4 CPU processes (tests/workers/dry_run_worker.py) count each rank's
  parameter, gradient and optimizer bytes and every collective's bytes in one train step; the dry
  run of the same config must predict every one of them exactly, and the analytic model (what the
  planner uses, no model built) must agree with the dry run.
- Dry runs of the 8B, 70B and 405B configs at 8, 64 and 512 ranks finish in well under a minute
  and hold (stage params x bytes) / shards per rank.
- The per-layer activation formula equals the bytes autograd saves in a real forward pass.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.launch import REPO, launch_worker, new_dump_folder, run_command
from torchtitan_amp import memory
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.torch_compat import grouped_fsdp_casts_every_output
from torchtitan_amp.distributed import context_parallel as cp_module
from torchtitan_amp.train import dry_run

pytestmark = [pytest.mark.dist, pytest.mark.oldest_torch]

# Mixed precision asked for: a dry run sizes GPUs ("auto" means on), the real runs it is checked
# against must not fall back to fp32 on a CPU that emulates bf16. The smallest flavor: the
# predictions are exact whatever the size, and its steps cost ~14x less than debugmodel's where
# bf16 is emulated; 4 blocks give Interleaved1F1B on PP 2 a block per stage, 2 heads split on TP 2.
BASE = (
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--mixed_precision.enabled",
    "true",
)
PP = ("--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2")
MOE = ("--model.name", "moe", "--model.flavor", "debugmodel_moe")

# Layouts per process count. The debug model's vocab (258) splits unevenly over 4 FSDP shards,
# so padding and short last shards are exercised.
JOBS = {
    1: {
        "single_autocast": [],
        "single_pure_bf16": ["--training.dtype", "bfloat16", "--mixed_precision.enabled", "false"],
        "single_pure_bf16_fp32_moments": [
            "--training.dtype",
            "bfloat16",
            "--mixed_precision.enabled",
            "false",
            "--optimizer.state_dtype",
            "float32",
        ],
        "single_bf16_moments_frozen": ["--optimizer.state_dtype", "bfloat16", "--training.freeze", "layers.0,norm"],
    },
    2: {
        "fsdp2": [],
        "fsdp2_ac_accum_bf16_reduce": [
            "--activation_checkpoint.mode",
            "full",
            "--training.global_batch_size",
            "8",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
        ],
        "ddp2_bf16_hook": [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
        ],
        "ddp2_fp32": [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
        "ddp2_frozen": [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
            "--training.freeze",
            "tok_embeddings,layers.1",
        ],
        "tp2_safe_norms_bf16_reduce": [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
            "--mixed_precision.lower_precision_safe_modules",
            "torch.nn.Linear,torchtitan_amp.models.llama3.model.RMSNorm",
        ],
        "tp2_frozen_bf16_moments": [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.freeze",
            "layers.0,output",
            "--optimizer.state_dtype",
            "bfloat16",
        ],
        "tp2": ["--parallelism.tensor_parallel_degree", "2"],
        "tp2_no_sp_ac": [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            "false",
            "--activation_checkpoint.mode",
            "full",
        ],
        # MoE: routers in the blocks' fp32 groups; under EP 2 each rank holds 4 of the 8 experts
        # (efsdp 1: no expert FSDP collective) and exchanges rows by all-to-all, again when recomputed
        # (the counts once: a recompute reuses the forward's).
        "moe_fsdp2": [*MOE],
        "moe_ep2_ac": [*MOE, "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
        # MoE under TP (autocast: fp32 residual stream, bf16 matmuls): each MoE layer gathers the
        # whole sequence (fp32), all-reduces its shared expert's bf16 output and fp32 input
        # gradient, and gathers its output gradient back (fp32).
        "moe_tp2": [*MOE, "--parallelism.tensor_parallel_degree", "2"],
    },
    4: {
        "fsdp4": [],
        "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
        "fsdp2_tp2_ac": ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
        "pp2_fsdp2_1f1b": [*PP],
        "pp2_fsdp2_interleaved": [*PP, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
        # Each microbatch's backward reshards and reduce-scatters: no unsharded gradient is held
        # across microbatches, one reduce-scatter per microbatch, a re-gather after each backward.
        "pp2_fsdp2_1f1b_reduce_per_microbatch": [*PP, "--parallelism.pipeline_fsdp_reduce", "per_microbatch"],
        "pp2_fsdp2_interleaved_reduce_per_microbatch_ac": [
            *PP,
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_fsdp_reduce",
            "per_microbatch",
            "--activation_checkpoint.mode",
            "full",
        ],
        "pp2_ddp2_gpipe": [
            *PP,
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
        ],
        "pp2_tp2": [*PP, "--parallelism.tensor_parallel_degree", "2"],
        # FSDP over dp_shard x cp = 4; K/V all-gathered over cp, their gradients reduce-scattered.
        "cp2_fsdp2": ["--parallelism.context_parallel_degree", "2"],
        # The experts' 4 ranks' worth of FSDP split as EP 2 x efsdp 2: their own all-gathers and
        # reduce-scatters over the efsdp pairs, sharded on dim 1.
        "moe_ep2_efsdp2": [*MOE, "--parallelism.expert_parallel_degree", "2"],
        # EP 2 x TP 2: the experts EP-split and replicated over tp; full AC recomputes every TP
        # collective of an MoE block but its shared expert's output all-reduce.
        "moe_ep2_tp2_ac": [
            *MOE,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
        # PP 2 x EP 2: each stage's MoE layers exchange rows over its own ep pair, per microbatch.
        "moe_pp2_ep2": [*MOE, *PP, "--parallelism.expert_parallel_degree", "2"],
        "cp2_fsdp2_ac_block_causal_bf16_cp_reduce": [
            "--parallelism.context_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
            "--model.attn_mask_type",
            "block_causal",
            "--mixed_precision.cp_reduce_dtype",
            "bfloat16",
        ],
    },
}


def _real_runs(tmp_path: Path, nproc: int) -> tuple[dict, dict[str, list[str]]]:
    jobs = {
        name: ["--job.dump_folder", str(new_dump_folder(tmp_path)), *BASE, *extra]
        for name, extra in JOBS[nproc].items()
    }
    out = tmp_path / "out"
    launch_worker("dry_run_worker", out, [{"name": n, "args": a} for n, a in jobs.items()], nproc, timeout=300)
    return json.loads((out / "result.json").read_text()), jobs


def _ep_mean(report: dict, ranks: list[dict], rank: int) -> dict[str, int]:
    """A rank's EP all-to-all, its rows averaged over the ranks of its pipeline stage: each rank
    sends its own rows (dispatch forward, combine's gradient) but returns what it received
    (combine forward, dispatch's gradient), which depends on the routing; over an EP group what
    is received is what is sent, so the mean is exact (the ranks of one stage hold the same MoE
    layers; another stage's may hold more or fewer). The split sizes are exact per rank."""
    peers = [r for r in ranks if r["pp_rank"] == ranks[rank]["pp_rank"]]
    sent = {d: sum(r["comm"]["ep_all_to_all"][d] for r in peers) for d in ranks[rank]["comm"]["ep_all_to_all"]}
    mean = {d: v // len(peers) if d != "int64" else ranks[rank]["comm"]["ep_all_to_all"][d] for d, v in sent.items()}
    assert all(v * len(peers) == sent[d] for d, v in mean.items() if d != "int64"), sent
    return mean


def _total(comm: dict[str, dict[str, int]]) -> int:
    return sum(sum(d.values()) for d in comm.values())


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_dry_run_predicts_real_runs_exactly(tmp_path: Path, nproc: int) -> None:
    real, jobs = _real_runs(tmp_path, nproc)
    for name, args in jobs.items():
        config = load_config(args)
        res = dry_run.resolve(config, nproc)
        for rank, measured in enumerate(real[name]):
            where = f"{name}, rank {rank}"
            report = dry_run.run(config, world_size=nproc, rank=rank, write=False)
            mem = report["memory"]
            for key in ("params", "grads", "optimizer"):
                assert mem[key] == measured[key], f"{where}: {key} dry run {mem[key]} != real {measured[key]}"
            # Traffic of the forward/backward passes: every category, every dtype, every byte.
            # What the worker tagged with its phase (the gradient norm's scalars, and any optimizer
            # collective) is outside the model and bounded by that description: since the trainer
            # sums TP's Partial norm gradients once (modelled), no gradient is reduced there again.
            modelled = {k: v for k, v in measured["comm"].items() if ":" not in k}
            if "ep_all_to_all" in modelled:
                modelled["ep_all_to_all"] = _ep_mean(report, real[name], rank)
            assert report["communication"] == modelled, f"{where}: dry run {report['communication']} != real {modelled}"
            # One call per FSDP group per gather / reduction: a block's fp32 norms share a group.
            predicted = report["fsdp_collective_calls"]
            assert predicted == {k: measured["comm_calls"].get(k, 0) for k in predicted}, (
                f"{where}: dry run calls {predicted} != real {measured['comm_calls']}"
            )
            in_blocks = [
                g["name"] for g in report["fsdp_groups"] if g["kind"] == "fp32" and g["name"].startswith("layers.")
            ]
            if grouped_fsdp_casts_every_output():
                assert all("attention_norm" in n and "ffn_norm" in n for n in in_blocks), f"{where}: {in_blocks}"
            else:  # older torch: one fp32 group per norm (torch_compat), and per MoE router
                norms = [n for n in in_blocks if not n.endswith(".router")]
                assert all(n.count("_norm") == 1 for n in norms) and len(norms) % 2 == 0, f"{where}: {in_blocks}"
            _check_pp_held(report, measured, res, where)
            unmodelled = _total({k: v for k, v in measured["comm"].items() if ":" in k})
            assert not any(k.startswith("optimizer:") for k in measured["comm"]), f"{where}: {measured['comm']}"
            assert unmodelled <= 16 * mem["num_param_tensors"], f"{where}: {measured['comm']}"
            # The analytic model (no model built: what the planner sees) agrees with the dry run.
            c = report["coordinates"]
            kw = dict(pp_rank=c["pp"], tp_rank=c["tp"])
            fsdp_rank = res.layout.fsdp_rank(c["dp_shard"], c["cp"])
            state = memory.state_bytes(res.model_dims, res.precision, res.layout, dp_shard_rank=fsdp_rank, **kw)
            assert (state.params, state.grads, state.optimizer) == (mem["params"], mem["grads"], mem["optimizer"]), (
                where
            )
            assert mem["analytic_state_matches"], where
            assert memory.comm(res.model_dims, res.precision, res.layout, **kw) == report["communication"], where
            groups = [
                (
                    s.index,
                    g.name,
                    g.kind,
                    g.unsharded_numel(res.layout.fsdp_shard),
                    g.gather_dtype,
                    g.reduce_dtype,
                    g.reshard_after_forward,
                )
                for s in memory.rank_stages(res.model_dims, res.layout, c["pp"])
                for g in memory.fsdp_groups(res.model_dims, res.precision, res.layout, s, c["tp"])
            ]
            assert sorted(tuple(g.values()) for g in report["fsdp_groups"]) == (
                sorted(groups) if res.dims.fsdp_enabled else []
            ), where
        if nproc == 1:
            assert real[name][0]["comm"] == {} and report["communication"] == {}


def _check_pp_held(report: dict, measured: dict, res, where: str) -> None:  # type: ignore[no-untyped-def]
    """Under PP: the microbatches each stage held at once, and under FSDP the most bytes of
    gathered params and unsharded gradients alive at once (tests/workers/pp_held.py), equal to
    the dry run's in-flight count and FSDP transient."""
    held = measured["pp_held"]
    if held is None:
        return
    pp_rank = report["coordinates"]["pp"]
    predicted = {s: memory.in_flight_microbatches(res.layout, int(s), pp_rank) for s in held["in_flight"]}
    assert predicted == held["in_flight"], f"{where}: in flight dry run {predicted} != real {held['in_flight']}"
    if not res.dims.fsdp_enabled:
        return
    dry, real = report["memory"]["transient"], held["fsdp"]
    if not any(g["kind"] == "experts" for g in report["fsdp_groups"]):
        assert dry == real, f"{where}: FSDP held dry run {dry} != real {real}"
        return
    # An MoE block's own gradients computed before its routed experts' group takes theirs (the
    # shared expert's) are alive then too and not modelled: short by less than one block.
    block = max(
        g["unsharded_numel"] * memory.DTYPE_BYTES[g["gather_dtype"]]
        for g in report["fsdp_groups"]
        if g["kind"] == "block"
    )
    assert 0 <= memory.sum_bytes(real) - memory.sum_bytes(dry) < block, f"{where}: FSDP held dry run {dry}, real {real}"


def _stage_numel(model: memory.ModelDims, stage: memory.Stage) -> int:
    return sum(math.prod(p.shape) for p in memory.param_specs(model, stage))


@pytest.mark.parametrize(
    "config_file, world, rank, degrees",
    [
        ("llama3_70b.toml", 64, 13, {"pp": 1, "dp_shard": 8, "tp": 8}),
        ("llama3_405b.toml", 512, 300, {"pp": 8, "dp_shard": 8, "tp": 8}),
    ],
)
def test_large_configs_dry_run_fast_and_shard_params(
    tmp_path: Path, config_file: str, world: int, rank: int, degrees: dict[str, int]
) -> None:
    # 8 sequences per pipeline rank: 1F1B needs at least pp microbatches.
    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / config_file),
            "--job.dump_folder",
            str(tmp_path),
            "--dry_run.vocab_size",
            "128256",
            "--training.local_batch_size",
            "8" if degrees["pp"] > 1 else "1",
        ]
    )
    report = dry_run.run(config, world_size=world, rank=rank)
    assert report["elapsed_s"] < 60, report["elapsed_s"]
    assert {k: report["degrees"][k] for k in degrees} == degrees
    assert json.loads((tmp_path / dry_run.REPORT_NAME).read_text())["memory"] == report["memory"]
    _check_param_shards(report, degrees)


@pytest.mark.parametrize(
    "degrees", [{"pp": 1, "dp_shard": 8, "cp": 8, "tp": 1}, {"pp": 1, "dp_shard": 4, "cp": 8, "tp": 2}]
)
def test_llama3_8b_131072_tokens_on_64_with_context_parallel(tmp_path: Path, degrees: dict[str, int]) -> None:
    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / "llama3_8b.toml"),
            "--job.dump_folder",
            str(tmp_path),
            "--dry_run.vocab_size",
            "128256",
            "--training.seq_len",
            "131072",
            "--activation_checkpoint.mode",
            "full",
            "--parallelism.context_parallel_degree",
            str(degrees["cp"]),
            "--parallelism.tensor_parallel_degree",
            str(degrees["tp"]),
        ]
    )
    report = dry_run.run(config, world_size=64, rank=0, write=False)
    assert report["elapsed_s"] < 60, report["elapsed_s"]
    assert {k: report["degrees"][k] for k in degrees} == degrees
    _check_param_shards(report, {"dp_shard": degrees["dp_shard"] * degrees["cp"], "tp": degrees["tp"]})
    res = dry_run.resolve(config, 64)
    assert report["communication"] == memory.comm(res.model_dims, res.precision, res.layout)
    # K and V (8 kv heads x 128 / tp, bf16) of the whole window, per layer: forward, recompute, backward (fp32).
    kv = 2 * 131072 * 8 * 128 // degrees["tp"]
    cp = report["communication"]
    assert cp["cp_all_gather"]["bfloat16"] == 2 * 32 * kv * 2 and cp["cp_reduce_scatter"] == {"float32": 32 * kv * 4}
    assert report["training"]["tokens_per_microbatch"] == 131072 // 8


def _check_param_shards(report: dict, degrees: dict[str, int]) -> None:
    """(stage params x 4 bytes) / (dp_shard x tp), up to uneven shards and TP-replicated norms."""
    m = report["model"]
    model = memory.ModelDims(m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["ffn_hidden"], m["vocab_size"])
    assert model.total_params() == m["total_params"]
    stages = {s["stage"]: s for s in report["pipeline"]["stages"]}
    numel = 0
    for sid in report["pipeline"]["this_rank"]:
        s = stages[sid]
        numel += _stage_numel(model, memory.Stage(sid, range(*s["layers"]), s["embeddings"], s["output"]))
    expected = numel * 4 / (degrees["dp_shard"] * degrees["tp"])
    measured = report["memory"]["params"]["float32"]
    assert abs(measured - expected) <= 1e-3 * expected, (measured, expected)
    assert report["memory"]["grads"] == report["memory"]["params"]
    assert report["memory"]["optimizer"]["float32"] == 2 * measured + 4 * report["memory"]["num_param_tensors"]
    assert report["memory"]["analytic_state_matches"]


def test_fake_backend_launcher_8b_on_8(tmp_path: Path) -> None:
    """COMM_MODE=fake_backend ./run_llama_train.sh: one process, NGPU simulated ranks, no torchrun."""
    result = run_command(
        [
            "bash",
            str(REPO / "run_llama_train.sh"),
            "--job.dump_folder",
            str(tmp_path),
            "--dry_run.vocab_size",
            "128256",
        ],
        timeout=240,
        env={
            "COMM_MODE": "fake_backend",
            "NGPU": "8",
            "DRY_RUN_RANK": "5",
            "CONFIG_FILE": str(REPO / "train_configs" / "llama3_8b.toml"),
        },
    )
    assert result.returncode == 0, result.describe()
    assert "torch.distributed.run" not in result.output and "rank 5 of 8" in result.stdout
    assert "fsdp_all_gather" in result.stdout and "parameters" in result.stdout
    report = json.loads((tmp_path / dry_run.REPORT_NAME).read_text())
    assert (report["world_size"], report["rank"]) == (8, 5)
    assert report["elapsed_s"] < 60
    _check_param_shards(report, {"dp_shard": 8, "tp": 1})
    # bf16 params gathered twice (forward, backward re-gather) except the root and last block;
    # fp32 gradients reduce-scattered once: the plan's dtypes halve/double the volumes.
    comm = report["communication"]
    params = report["model"]["total_params"]
    assert 1.7 * params * 2 < comm["fsdp_all_gather"]["bfloat16"] < 2 * params * 2
    assert abs(comm["fsdp_reduce_scatter"]["float32"] - params * 4) <= 1e-3 * params * 4


def test_bf16_reduce_halves_reduce_scatter(tmp_path: Path) -> None:
    args = ["--job.config_file", str(REPO / "train_configs" / "llama3_8b.toml"), "--job.dump_folder", str(tmp_path)]
    fp32 = dry_run.run(load_config(args), world_size=8, write=False)["communication"]["fsdp_reduce_scatter"]
    bf16 = dry_run.run(load_config(args + ["--mixed_precision.reduce_dtype", "bfloat16"]), world_size=8, write=False)[
        "communication"
    ]["fsdp_reduce_scatter"]
    # Linear weights' gradients travel in bf16; norms and embeddings stay fp32.
    assert bf16["bfloat16"] == fp32["float32"] // 2 - bf16["float32"] // 2
    assert bf16["float32"] < 0.05 * fp32["float32"]


def test_bad_rank_is_a_config_error(tmp_path: Path) -> None:
    config = load_config(["--job.dump_folder", str(tmp_path), "--parallelism.data_parallel_shard_degree", "4"])
    with pytest.raises(ConfigError, match="dry_run.rank"):
        dry_run.run(config, world_size=4, rank=4, write=False)
    with pytest.raises(ConfigError, match="world size 6"):
        dry_run.run(config, world_size=6, rank=0, write=False)


# ---------------------------------------------------------------------------------------------
# Activations: the per-layer formula against the tensors autograd saves


def _saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor, context, **extra) -> int:  # type: ignore[no-untyped-def]
    """Bytes of distinct storages saved for backward that hold activations: tensors led by the
    batch or batch x seq dimension (not weights, their bf16 casts, or the rotary tables), and
    tensors outside autograd (masks and indices shared by the batch; the per-stage ones, token
    ids and rotary buffers, cancel in a difference of layer counts)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, s = tokens.shape
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        batch_led = t.dim() >= 2 and t.shape[0] in (b, b * s)
        if (batch_led or (t.grad_fn is None and not t.requires_grad)) and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context():
        model(tokens, **extra)
    return sum(seen.values())


@pytest.mark.parametrize(
    "kv_heads, precision, mask_type, cp",
    [
        *((kv, p, "causal", 1) for kv in (4, 1) for p in ("autocast_bf16", "fp32")),
        (4, "fp32", "block_causal", 1),
        (1, "autocast_bf16", "block_causal", 1),
        (4, "autocast_bf16", "block_causal", 2),
        (1, "fp32", "causal", 2),
        (4, "autocast_bf16", "causal", 4),
        # GQA, 2 query heads per kv head: this CPU's kernel takes the window's K/V grouped in fp32 (no
        # repeated copy; a GPU's flash kernel in 16 bits), repeats them in bf16 (CUDA's layer_cpu delta)
        (2, "fp32", "causal", 2),
        (2, "autocast_bf16", "causal", 2),
        (2, "fp32", "block_causal", 2),
    ],
)
def test_activation_formula_matches_saved_tensors(kv_heads: int, precision: str, mask_type: str, cp: int) -> None:
    """Also with an explicit mask (SDPA saves an additive copy per layer) and under context
    parallel: cp rank 1 (a fake process group: the gathered keys' values do not matter, only
    their shapes), holding S / cp queries against the window's S keys and values; causal CP
    attends chunk by chunk, and on this CPU SDPA saves each chunk's causal mask, which CUDA's
    kernels do not build: the check adds that CPU-only term (ActivationTerms.layer_cpu, counted
    for ranks > 0; rank 0's first chunk needs none)."""
    from torchtitan_amp.distributed.context_parallel import ContextParallel, head_tail_positions
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer
    from torchtitan_amp.precision import PrecisionPlan, autocast, memory_spec

    args = ["--mixed_precision.enabled", "false" if precision == "fp32" else "true"]
    config = load_config(args)
    plan = PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu")
    b, s = 2, 64
    extra = {} if mask_type == "causal" else {"doc_ids": torch.arange(b * s // cp, dtype=torch.int32).view(b, -1) // 16}
    created = dry_run.init_fake_process_group(cp, 1) if cp > 1 else False
    try:
        if cp > 1:
            extra["positions"] = head_tail_positions(s, cp, 1).expand(b, -1)
            if "doc_ids" in extra:  # the window's, as BatchSharder hands them (values do not matter)
                extra["kv_doc_ids"] = torch.cat([extra["doc_ids"]] * cp, dim=1)
        measured = {}
        for layers in (1, 3):
            margs = LlamaModelArgs(
                dim=256, n_layers=layers, n_heads=4, n_kv_heads=kv_heads, vocab_size=258, multiple_of=256, max_seq_len=s
            )
            torch.manual_seed(0)
            model = Transformer(margs)
            model.init_weights()
            autocast.apply_fp32_islands(plan, model)
            if cp > 1:
                cp_module.apply_cp(model, ContextParallel(torch.distributed.group.WORLD))
            tokens = torch.randint(0, 258, (b, s // cp))
            context = functools.partial(autocast.forward_context, plan)
            measured[layers] = _saved_activation_bytes(model, tokens, context, **extra)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    per_layer = (measured[3] - measured[1]) / 2
    layout = memory.Layout(seq_len=s, local_batch_size=b, cp=cp, attn_mask_type=mask_type)
    terms = memory.activation_terms(memory.ModelDims.from_args(margs), memory_spec.from_plan(plan), layout)
    predicted = (terms.layer + terms.layer_cpu) * layout.microbatch_tokens
    assert per_layer == predicted, (per_layer, predicted)


# ---------------------------------------------------------------------------------------------
# Pieces of the analytic model that mirror torchtitan_amp code


def test_stage_split_and_chunks_mirror_torch_and_pipeline() -> None:
    from torchtitan_amp.core.rules import FLAVORS
    from torchtitan_amp.distributed.pipeline import stage_boundaries
    from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS

    assert tuple(LLAMA3_FLAVORS) == FLAVORS  # the torch-free flavor list names every model
    for n_layers in (6, 32, 80, 126):
        for stages in (1, 2, 3, 8, 16):
            if stages <= n_layers:
                ranges = memory.stage_layer_ranges(n_layers, stages)
                assert [r.start for r in ranges] == stage_boundaries(n_layers, stages, [])
                assert ranges[-1].stop == n_layers
    for n in (1, 7, 258, 128256):
        for parts in (1, 2, 3, 8):
            sizes = [c.shape[0] for c in torch.chunk(torch.empty(n), parts)]
            sizes += [0] * (parts - len(sizes))
            assert [memory.chunk_size(n, parts, i) for i in range(parts)] == sizes


def test_1f1b_order_and_fsdp_gathers() -> None:
    assert memory.schedule_ops("1F1B", 4, 2, 0) == list("FFBFBFBB")
    assert memory.schedule_ops("1F1B", 4, 2, 1) == list("FBFBFBFB")
    assert memory.schedule_ops("GPipe", 2, 2, 0) == list("FFBB")
    resharded = memory.FsdpGroup("b", 10, "bfloat16", "float32", True, "block")
    kept = memory.FsdpGroup("r", 10, "bfloat16", "float32", False, "root")
    assert memory.fsdp_gathers_per_step(resharded, ["F", "B"], pp=False) == 2
    assert memory.fsdp_gathers_per_step(kept, ["F", "B"], pp=False) == 1
    # Under PP params stay gathered after backward: FFBFBFBB gathers at F1, F2 (after F), B0, B1 (after F) ...
    assert memory.fsdp_gathers_per_step(resharded, list("FFBFBFBB"), pp=True) == 5
    assert memory.fsdp_gathers_per_step(kept, list("FFBFBFBB"), pp=True) == 1
    # Reduced per microbatch, each backward reshards: every F after a B and every B after a B
    # gathers; FSDP2's backward prefetch re-gathers its target once in a B after two Fs.
    assert memory.fsdp_gathers_per_step(kept, list("FFBFBFBB"), pp=True, per_microbatch=True) == 4
    assert memory.fsdp_gathers_per_step(kept, list("FFBFBFBB"), pp=True, per_microbatch=True, mistargeted=True) == 5


def test_interleaved_order_mirrors_torch() -> None:
    """The Interleaved1F1B order the model simulates is torch's own, rank by rank."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    for pp, m in ((2, 4), (2, 8), (4, 8), (8, 32)):
        schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
        schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, 2, m
        schedule.number_of_rounds = max(1, m // pp)
        schedule.microbatches_per_round = m // schedule.number_of_rounds
        for rank in range(pp):
            ops = [
                (a.stage_index, "F" if a.computation_type == _ComputationType.FORWARD else "B")
                for a in schedule._calculate_single_rank_operations(rank)
                if a is not None
            ]
            assert memory.interleaved_order(pp, m, 2, rank) == ops, (pp, m, rank)


@pytest.mark.parametrize("flavor, vocab, world, ep", [("qwen3_30b_a3b", 151936, 64, 8), ("moe_16b_gqa", 102400, 32, 8)])
def test_moe_dry_run_total_vs_active_and_expert_parallel(
    tmp_path: Path, flavor: str, vocab: int, world: int, ep: int
) -> None:
    """An MoE model at size: every expert is held (sharded EP x efsdp like the rest over FSDP),
    a token uses top_k of them (active), and each MoE layer exchanges its T x top_k rows by
    all-to-all four times (dispatch and combine, forward and backward)."""
    config = load_config(
        [
            "--model.name",
            "moe",
            "--model.flavor",
            flavor,
            "--job.dump_folder",
            str(tmp_path),
            "--dry_run.vocab_size",
            str(vocab),
            "--training.seq_len",
            "4096",
            "--training.local_batch_size",
            "1",
            "--parallelism.expert_parallel_degree",
            str(ep),
        ]
    )
    report = dry_run.run(config, world_size=world, rank=0, write=False)
    assert report["elapsed_s"] < 60, report["elapsed_s"]
    res = dry_run.resolve(config, world)
    dims, m = res.model_dims, report["model"]
    assert m["total_params"] == dims.total_params() and m["active_params"] == dims.active_params() < m["total_params"]
    assert report["degrees"]["ep"] == ep and report["degrees"]["efsdp"] == world // ep
    assert report["memory"]["analytic_state_matches"]
    # Experts and the rest alike are split over all the ranks: ~4 bytes x total / ranks.
    held = report["memory"]["params"]["float32"]
    assert abs(held - 4 * m["total_params"] / world) < 0.01 * held
    assert report["communication"] == memory.comm(dims, res.precision, res.layout)
    moe_layers = dims.moe_layers()
    rows = 4096 * dims.top_k * dims.dim * 2  # bf16
    assert report["communication"]["ep_all_to_all"] == {
        "bfloat16": 4 * moe_layers * rows,
        "int64": moe_layers * dims.n_routed_experts * 8,
    }
    assert "expert_fsdp_all_gather" in report["communication"]
    assert "active per token" in dry_run.format_table(report) and f"ep {ep}" in dry_run.format_table(report)


def test_pipeline_fsdp_reduce_needs_fsdp(tmp_path: Path) -> None:
    """Choosing when FSDP reduces under PP is a config error on a layout without FSDP."""
    args = ["--job.dump_folder", str(tmp_path), *BASE, *PP, "--parallelism.pipeline_fsdp_reduce", "per_microbatch"]
    assert dry_run.resolve(load_config(args), 4).layout.pp_fsdp_reduce == "per_microbatch"
    with pytest.raises(ConfigError, match="pipeline_fsdp_reduce"):
        dry_run.resolve(
            load_config(
                [
                    *args,
                    "--parallelism.data_parallel_replicate_degree",
                    "2",
                    "--parallelism.data_parallel_shard_degree",
                    "1",
                ]
            ),
            4,
        )
