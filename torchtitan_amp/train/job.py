"""One setup path for every entry point: `resolve` turns a job config and a world size into a
`Job`, running every config-time check in one ordered place before any process group exists, and
`build_model_parts` builds this rank's parallelized model parts from it. The trainer, the dry run
and the tools call these two, so a dry run cannot drift from a real run.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from torchtitan_amp import memory
from torchtitan_amp.checkpoint import validate_config as validate_checkpoint_config
from torchtitan_amp.config import ConfigError, JobConfig, TrainingConfig
from torchtitan_amp.core.environment import torchft_missing, wandb_missing
from torchtitan_amp.core.matmul_speed import low_precision_speed
from torchtitan_amp.data.chat_template import chosen_template
from torchtitan_amp.data.tokenizer import Tokenizer, build_tokenizer
from torchtitan_amp.distributed.context_parallel import check_causal_kernel
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.distributed.pipeline import stage_module
from torchtitan_amp.distributed.tensor_parallel import linear_shard_dims
from torchtitan_amp.eval.validation import ValidationSpec, resolve_spec
from torchtitan_amp.models import ModelFamily, count_params, get_family
from torchtitan_amp.models.attention import MaskInputs
from torchtitan_amp.observability import profiling
from torchtitan_amp.precision import PrecisionPlan, block_scaled, by_name, freeze, lora, memory_spec
from torchtitan_amp.precision.lowbit import capability, float8, torchao_kernels
from torchtitan_amp.train.parallelize import check_mtp, check_weight_tying, parallelize_model, validate_layout

# Below this size every rank initialises the full model from the seed and then shards it, so any
# parallel layout starts from bit-identical weights; above it, init happens on the sharded params.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def grad_accum_steps(t: TrainingConfig, dp_degree: int) -> int:
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"'training.global_batch_size' = {t.global_batch_size} is not a multiple of "
            f"local_batch_size x dp degree = {t.local_batch_size} x {dp_degree} = {per_step}"
        )
    return t.global_batch_size // per_step


@dataclass(frozen=True)
class Job:
    """A job config resolved for `world_size` ranks on `device_type`: everything decided before
    a process group or a model exists."""

    config: JobConfig
    world_size: int
    device_type: str
    dims: ParallelDims
    accum: int  # gradient-accumulation steps per optimizer step
    plan: PrecisionPlan
    tokenizer: Tokenizer | None  # None in a dry run given dry_run.vocab_size
    model_args: Any  # the family's args dataclass (LlamaModelArgs for llama3)
    boundaries: tuple[int, ...]  # first layer of each pipeline stage; (0,) without PP
    n_microbatches: int  # pipeline microbatches per local batch; 1 without PP
    validation: ValidationSpec | None  # None: validation off

    @property
    def family(self) -> ModelFamily:
        """The model family model.name picks (checked against the registry at config time)."""
        return get_family(self.config.model.name)

    @property
    def layout(self) -> memory.Layout:
        p, t, ac = self.config.parallelism, self.config.training, self.config.activation_checkpoint
        dims = self.dims
        return memory.Layout(
            dp_replicate=dims.dp_replicate,
            dp_shard=dims.dp_shard,
            tp=dims.tp,
            pp=dims.pp,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            grad_accum=self.accum,
            pp_schedule=p.pipeline_parallel_schedule,
            pp_microbatch_size=p.pipeline_parallel_microbatch_size,
            sequence_parallel=p.enable_sequence_parallel,
            loss_parallel=not p.disable_loss_parallel,
            ac_mode=ac.mode,
            ac_option=ac.selective_ac_option,
            op_sac_save_mm=ac.per_op_sac_save_mm,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            split_points=self.boundaries[1:],
            cp=dims.cp,
            attn_mask_type=self.config.model.attn_mask_type,
            attention_backend=self.plan.attention_backend,
            ep=dims.ep,
            pp_fsdp_reduce=p.pipeline_fsdp_reduce,
            replica_groups=self.config.fault_tolerance.group_size if self.config.fault_tolerance.enable else 1,
            sync_steps=self.plan.sync_steps,
        )

    @property
    def model_dims(self) -> memory.ModelDims:
        return self.family.memory_dims(self.model_args)

    @property
    def precision(self) -> memory.PrecisionSpec:
        return memory_spec.from_plan(self.plan, self.family.norm_cls)

    @functools.cached_property
    def mask_inputs(self) -> MaskInputs:
        """The extra forward arguments model.attn_mask_type needs (document ids for block_causal).
        A dry run without a tokenizer has no BOS / EOS: every window is one document. On chat data
        (`chat:`) only BOS starts a document: each conversation starts with one, and its turns may
        end with EOS inside it (data/chat.py)."""
        bos, eos = (self.tokenizer.bos_id, self.tokenizer.eos_id) if self.tokenizer is not None else (-1, -1)
        if self.config.training.dataset.startswith("chat:"):
            eos = -1
        return MaskInputs(self.config.model.attn_mask_type, bos, eos, host_ids=self.plan.attention_backend == "flex")

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline stages rank `pp_rank` holds ([0] without PP)."""
        return self.layout.stage_ids(pp_rank)


def check_mask_type(mask_type: str, family: ModelFamily, cp: int = 1) -> None:
    """A family takes document masking by accepting `doc_ids` in its model's forward, and context
    parallel by accepting `positions` (context_parallel.BatchSharder hands both): ConfigError
    otherwise.

    Args:
        mask_type: model.attn_mask_type ("causal", "block_causal").
        family: the model family whose model's forward is inspected.
        cp: the context-parallel degree; above 1 the forward must take `positions`.
    """
    forward = getattr(family.model_cls, "forward", family.model_cls)
    takes = inspect.signature(forward).parameters
    if mask_type != "causal" and "doc_ids" not in takes:
        raise ConfigError(
            f"'model.attn_mask_type' = '{mask_type}' is not supported by model.name = "
            f"'{family.name}' (its model's forward takes no doc_ids); use 'causal'"
        )
    if cp > 1 and "positions" not in takes:
        raise ConfigError(
            f"'parallelism.context_parallel_degree' = {cp} is not supported by model.name = "
            f"'{family.name}' (its model's forward takes no positions); use 1"
        )


def check_cp_attention(job: Job, device_type: str) -> None:
    """Causal context parallel on a kernel that takes its lower-right bias (no mask tensor on
    CUDA): context_parallel.check_causal_kernel, with the job's compute dtype and head_dim. Not
    asked where no SDPA call takes that bias: the flex backend (a BlockMask over the gathered keys)
    and a family with masks beyond causal (gpt-oss's sinks and windows: its own fp32 softmax)."""
    if job.config.model.attn_mask_type != "causal" or not job.dims.cp_enabled:
        return
    family_masks: tuple[str, ...] = getattr(job.family.model_cls, "attention_masks", ())
    if job.plan.attention_backend == "flex" or family_masks:
        return
    prec = job.precision
    field = "mixed_precision.param_dtype" if prec.low("linear") else "training.dtype"
    where = f"{field}, model.flavor '{job.config.model.flavor}'"
    check_causal_kernel(device_type, prec.compute, job.model_args.head_dim, job.dims.cp, where)


def resolve(
    config: JobConfig, world_size: int, device_type: str, *, dry_run: bool = False, preflight: bool = False
) -> Job:
    """Every config-time check, in order; raises ConfigError (or PrecisionError, DataError from
    the tokenizer) naming the field.

    Args:
        config: the job config.
        world_size: the job's ranks (torchrun's WORLD_SIZE, or the dry run's).
        device_type: the device the job trains on ("cuda", "cpu").
        dry_run: True when the machine is not the one being sized: its CPU is not asked whether
            bf16 is native ("auto" means on), `dry_run.vocab_size` may replace the tokenizer's, and
            this machine's checkpoint folder and profiler are not checked.
        preflight: True for the launcher's check before torchrun starts: the precision probes run
            no kernel (capability only).
    """
    t, p = config.training, config.parallelism
    dims = ParallelDims.from_config(p, world_size)
    accum = grad_accum_steps(t, dims.dp_degree)
    plan = PrecisionPlan.from_config(
        config, dims, device_type, probe=None if dry_run else low_precision_speed, run_kernels=not preflight
    )
    if not dry_run:
        validate_checkpoint_config(config, world_size, device_type)
        profiling.validate(config, device_type)
        # An environment check, not a config rule: the same config is fine where wandb is installed.
        if config.metrics.enable_wandb and (missing := wandb_missing()) is not None:
            raise ConfigError(missing)
        if config.fault_tolerance.enable and (missing := torchft_missing()) is not None:
            raise ConfigError(missing)
    # A dry run told the vocabulary size need not read a tokenizer file of the machines it sizes.
    tokenizer = None if dry_run and config.dry_run.vocab_size else build_tokenizer(config.model.tokenizer)
    vocab = tokenizer.vocab_size if tokenizer is not None else config.dry_run.vocab_size
    if t.chat_template:
        chosen_template(t.chat_template)  # an unknown name or missing file: one line, before any process group
        if tokenizer is not None:
            tokenizer.chat_template = t.chat_template  # what data/chat_template.template_for renders
    family = get_family(config.model.name)
    check_mask_type(config.model.attn_mask_type, family, dims.cp)
    args = family.build_args(config.model.flavor, vocab, t.seq_len)
    boundaries, n_microbatches = validate_layout(dims, config, args.n_heads, args.kv_heads, args.n_layers, device_type)
    check_weight_tying(args, dims, config.model.flavor)
    check_mtp(args, dims, config.model.flavor)
    validation = resolve_spec(config, args.max_seq_len, n_microbatches if dims.pp_enabled else None, tokenizer)
    if plan.fp8 != "none" or plan.block_scaled is not None or plan.fp32_names or plan.frozen_names or plan.lora:
        with torch.device("meta"):
            model = family.build_model(args)
        by_name.mark_fp32_by_name(plan, model)
        freeze.freeze(plan, model)
        lora.apply_lora(plan, model)
        float8.check_fp8_modules(model, plan.fp8, plan.fp8_skip)
        block_scaled.check_modules(
            model, plan.block_scaled, plan.block_scaled_skip, plan.block_scaled_edge_layers, plan.block_scaled_experts
        )
        if dims.tp_enabled:
            block_scaled.check_tensor_parallel(
                model,
                plan.block_scaled,
                plan.block_scaled_skip,
                plan.block_scaled_edge_layers,
                dims.tp,
                linear_shard_dims(model, family.tp_block_plan),
            )
    job = Job(
        config,
        world_size,
        device_type,
        dims,
        accum,
        plan,
        tokenizer,
        args,
        tuple(boundaries),
        n_microbatches,
        validation,
    )
    # A dry run asks what its target device (dry_run.device) would run, whatever machine it runs on.
    check_cp_attention(job, device_type)
    return job


@dataclass
class ModelParts:
    parts: list[nn.Module]  # one per pipeline stage this rank holds (the whole model without PP)
    stage_ids: list[int]
    num_params: int  # of the whole model
    flops_per_token: float  # of the whole model, training (forward + backward)


def nf4_base_loaded(job: Job) -> bool:
    """QLoRA on FSDP starting from checkpoint.initial_load_path (a resume too: LoRA's checkpoint
    points at that base): whatever the model's size, it is built on meta, its bases quantized there
    and split, and the load fills each rank's NF4 rows of the whole weight; nothing initialises them."""
    lp = job.plan.lora
    return lp is not None and lp.nf4 and lp.nf4_shards > 1 and bool(job.config.checkpoint.initial_load_path)


def init_on_shards(job: Job, part: nn.Module, device: torch.device) -> None:
    """Materialise a parallelized part on `device` and initialise it on its shards: the model's own
    init_weights (NF4 bases left out: they come from the load) and the adapters'.

    Args:
        job: the resolved job (its plan's [lora]).
        part: a parallelized part still on meta.
        device: where it is materialized.
    """
    part.to_empty(device=device)
    lora.materialize_nf4(part, device)
    with torch.no_grad(), lora.nf4_bases_aside(part):
        cast(Any, part).init_weights(buffer_device=device)
        lora.init_adapters(part)
    lora.quantize_base(job.plan, part)


def build_model_parts(job: Job, device: torch.device, stage_ids: list[int], *, materialize: bool = True) -> ModelParts:
    """Build on meta in the plan's storage dtype, split into `stage_ids`, parallelize each part
    (TP, AC, compile, FSDP/DDP). Models up to FULL_INIT_MAX_PARAMS are initialised from the seed
    on every rank before sharding, so every layout starts from identical weights; larger ones are
    initialised on their shards.

    Args:
        job: the resolved job: family, model args, layout, plan.
        device: where the parts are materialized.
        stage_ids: the pipeline stages this rank holds ([0] without PP).
        materialize: False (dry run): everything stays on meta, uninitialised.
    """
    args, t, family = job.model_args, job.config.training, job.family
    with torch.device("meta"):
        model = family.build_model(args)
    model.attention_backend = job.plan.attention_backend  # type: ignore[assignment]  # "sdpa" | "flex"
    freeze.apply_storage_dtype(job.plan, model)
    job.plan.apply_router_dtype(model)
    by_name.mark_fp32_by_name(job.plan, model)
    freeze.freeze(job.plan, model)
    lora.apply_lora(job.plan, model)
    if (
        materialize
        or job.plan.fp8 == "none"
        or capability.fp8_torchao_missing(job.plan.fp8, job.plan.fp8_all_gather) is None
    ):
        # torchao is an optional extra: a dry run without it keeps the nn.Linears, whose params and
        # shards are the same, and sizes their fp8 all-gather by the plan's rule (dry_run.py).
        float8.apply_fp8(model, job.plan.fp8, job.plan.fp8_skip, job.plan.fp8_all_gather)
    # The whole model, before the pipeline split: the edge blocks are counted on it.
    if job.plan.block_scaled_emulated or job.plan.block_scaled is None:
        block_scaled.apply_block_scaled(
            model,
            job.plan.block_scaled,
            job.plan.block_scaled_skip,
            job.plan.block_scaled_edge_layers,
            job.plan.block_scaled_experts,
        )
    elif materialize or capability.block_scaled_torchao_missing(job.plan.block_scaled.format) is None:
        # As fp8 above: a dry run without torchao keeps the nn.Linears (same params and shards).
        block_scaled.apply_torchao(
            model, job.plan.block_scaled, job.plan.block_scaled_skip, job.plan.block_scaled_edge_layers
        )
    num_params = count_params(model)
    fpt = family.flops_per_token(args, count_params(model, exclude_embedding=True), t.seq_len)
    torch.manual_seed(t.seed)
    base_loaded = nf4_base_loaded(job)
    initialised = materialize and num_params <= FULL_INIT_MAX_PARAMS and not base_loaded
    if initialised:
        model.to_empty(device="cpu")
        with torch.no_grad():
            cast(Any, model).init_weights()  # every family's model defines it (models/spec.py)
            lora.init_adapters(model)
        lora.quantize_base(job.plan, model)
        model.to(device)
    elif not materialize or base_loaded:
        # torchao quantizes on meta too: the dry run measures NF4's bytes, and FSDP splits the
        # meta NF4 bases that the load then fills (each weight read whole, quantized, rows kept).
        lora.quantize_base(job.plan, model)
    parts = []
    for sid in stage_ids:
        part = stage_module(model, sid, list(job.boundaries)) if job.dims.pp_enabled else model
        parallelize_model(part, family, job.dims, job.plan, job.config)
        if materialize:
            if not initialised:
                init_on_shards(job, part, device)
            part.train()
        parts.append(part)
    if materialize:
        torchao_kernels.materialized(parts)
    return ModelParts(parts, list(stage_ids), num_params, fpt)
