"""The job config's schema: one dataclass per TOML section (a Literal type is the allowed set), and
`JobConfig`, which holds them and remembers where each set field came from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan_amp.config.bounds import Bounds, Text, above, at_least, between
from torchtitan_amp.core.rules import (
    DtypeName,
    PipelineFsdpReduce,
    PipelineSchedule,
    ReshardPolicy,
    family_names,
    flavor_names,
)

# A boolean that may also be "auto" (mixed_precision.enabled).
BoolOrAuto = bool | Literal["auto"]
_AUTO = "auto"
# Fields that moved to another section: naming the old place is an error that says the new one.
MOVED_FIELDS = {
    "training.fault_inject_at_step": "debug.fault_inject_at_step",
    "training.fault_inject_rank": "debug.fault_inject_rank",
}
# Characters W&B refuses in a project name: refused here rather than by wandb.init after the
# model is built.
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def option(
    default: Any, help: str, choices: Callable[[], tuple[str, ...]] | None = None, bounds: Bounds | None = None
) -> Any:
    """A config field: `help` becomes the --help line; a Literal type is the allowed set, or
    `choices` for a set that grows at run time (asked each time a value is set); `bounds` what a
    value must be beyond its type (bounds.py), checked as it is set and shown by --help."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if bounds is not None:
        meta["bounds"] = bounds
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSectionConfig:
    """[job]: what the job is and where it writes (`JobConfig` is the whole config)."""

    config_file: str = option("", "TOML job config to load before CLI overrides.")
    dump_folder: str = option("./outputs", "Folder for logs, metrics.jsonl, reports and checkpoints.")
    description: str = option("", "Free-text description of the job, printed at start-up.")
    print_config: bool = option(False, "Print the resolved config (TOML) at start-up.")
    dry_run: bool = option(
        False,
        "Plan without hardware: one process builds the model on the meta device with a fake "
        "process group for dry_run.world_size ranks and reports rank dry_run.rank's parameter, "
        "gradient, optimizer, activation memory and communication per step (also set by "
        "COMM_MODE=fake_backend); writes <dump_folder>/dry_run.json. No training.",
    )


@dataclass
class ModelConfig:
    name: str = option(
        "llama3", "Model family: a folder models/<family>/ registered in models.FAMILIES.", choices=family_names
    )
    flavor: str = option(
        "debugmodel",
        "Model size: a flavor of the chosen family (models/<family>/; the "
        "built-in ones are listed, a tool may register more at run time).",
        choices=flavor_names,
    )
    tokenizer: str = option(
        "byte",
        "'byte' (built-in 256 bytes + BOS/EOS), a path to a tokenizer.json, or a "
        "Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json's BOS/EOS).",
    )
    attn_mask_type: Literal["causal", "block_causal"] = option(
        "causal",
        "'causal': a token attends to every earlier token of its window; 'block_causal' "
        "(document masking): only to those of its own document (a BOS, or the token after an EOS, "
        "starts one), as if each packed document were trained alone.",
    )


@dataclass
class OptimizerConfig:
    name: Literal["AdamW"] = option("AdamW", "Optimizer.")
    lr: float = option(8e-4, "Peak learning rate.", bounds=above(0))
    beta1: float = option(0.9, "AdamW beta1.", bounds=between(0, 1, high_open=True))
    beta2: float = option(0.95, "AdamW beta2.", bounds=between(0, 1, high_open=True))
    eps: float = option(1e-8, "AdamW epsilon.", bounds=above(0))
    weight_decay: float = option(0.1, "Decoupled weight decay.", bounds=at_least(0))
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = option(
        "auto",
        "AdamW kernel: 'auto' picks fused where the device supports it, else foreach. "
        "Applies to torch's AdamW, used unless state_dtype or stochastic_rounding ask for more.",
    )
    state_dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        "dtype of AdamW's exp_avg and exp_avg_sq: 'auto' = the parameters' storage dtype (fp32 "
        "master weights: fp32; training.dtype = bfloat16: bf16, as torch's AdamW does). 'bfloat16' with "
        "fp32 parameters saves 4 of 16 bytes per parameter; any other choice than the storage dtype "
        "runs a per-parameter AdamW that computes the update in fp32 (docs/mixed_precision.md).",
    )
    stochastic_rounding: bool = option(
        False,
        "Pure bf16 training only (training.dtype = bfloat16): round each updated weight to bf16 "
        "stochastically (unbiased) instead of to nearest, so that updates below half a bf16 ulp still "
        "move the weights on average. Random bits from (training.seed, step, parameter): replicas agree "
        "and a resumed run rounds exactly as the uninterrupted one.",
    )


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = option(200, "Linear warm-up steps from ~0 to optimizer.lr.", bounds=at_least(0))
    decay_ratio: float = option(
        -1.0,
        "Fraction of steps spent decaying at the end (-1: all steps after warm-up).",
        bounds=between(0, 1, also={-1: ""}),
    )
    decay_type: Literal["linear", "cosine", "sqrt"] = option("linear", "Shape of the decay.")
    min_lr_factor: float = option(0.0, "LR at the end of decay, as a fraction of optimizer.lr.", bounds=between(0, 1))


@dataclass
class TrainingConfig:
    dataset: str = option(
        "pydoc",
        "'pydoc' (CPython's bundled docs, no download), 'path:/file/or/folder' (.txt, .md, .jsonl; "
        "tokenised in memory at start-up) or 'tokens:/prepared/folder' (shards from "
        "`python -m torchtitan_amp.data prepare`, memory-mapped; ':validation' appended names the "
        "held-out split). See docs/data.md.",
    )
    dataloader_num_workers: int = option(
        0,
        "Loader worker processes per rank building batches ahead of the step ('tokens:' datasets "
        "only; the batches are the same for any number).",
        bounds=at_least(0),
    )
    local_batch_size: int = option(8, "Sequences per micro-batch per data-parallel rank.", bounds=at_least(1))
    global_batch_size: int = option(
        -1,
        "Sequences per optimizer step over all ranks (-1: local_batch_size x dp degree); "
        "larger values accumulate gradients.",
        bounds=at_least(1, also={-1: ""}),
    )
    seq_len: int = option(2048, "Tokens per sequence.", bounds=at_least(2))
    steps: int = option(10000, "Optimizer steps to train.", bounds=at_least(1))
    max_norm: float = option(1.0, "Gradient clipping by global norm (<= 0 disables).")
    seed: int = option(0, "Seed for model init and data order.")
    deterministic: bool = option(False, "Use deterministic algorithms (slower).")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "'auto' picks CUDA when a GPU is present, else CPU.")
    dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "Storage dtype of parameters (float32 = fp32 master weights; bfloat16 = pure-bf16 "
        "training, which needs mixed_precision.enabled = false or param_dtype = bfloat16).",
    )
    mixed_precision_param: Literal["", DtypeName] = option(
        "", "Alias of mixed_precision.param_dtype (torchtitan spelling)."
    )
    mixed_precision_reduce: Literal["", DtypeName] = option(
        "", "Alias of mixed_precision.reduce_dtype (torchtitan spelling)."
    )
    freeze: list[str] = option(
        [],
        "fnmatch patterns of module names whose parameters are frozen (no gradient, optimizer state "
        "or gradient reduction) and stored in their compute dtype: param_dtype for lower-precision-safe "
        "modules in mixed precision, else as trained ones; a pattern naming no module is an error.",
    )
    gc_freq: int = option(
        50, "Run Python's garbage collector every N steps (0: leave it automatic).", bounds=at_least(0)
    )
    skip_nonfinite_steps: bool = option(
        False,
        "Skip (and count) a step whose loss or grad norm is inf/nan instead of stopping the job "
        "(fp16 overflow is always handled by the loss scaler, not by this).",
    )


@dataclass
class ParallelismConfig:
    data_parallel_replicate_degree: int = option(1, "Replicas (DDP, or the replicate dim of HSDP).", bounds=at_least(1))
    data_parallel_shard_degree: int = option(
        -1, "FSDP shard degree; -1 fills the ranks not used by the other degrees.", bounds=at_least(1, also={-1: ""})
    )
    tensor_parallel_degree: int = option(1, "Tensor-parallel degree.", bounds=at_least(1))
    pipeline_parallel_degree: int = option(1, "Pipeline-parallel degree.", bounds=at_least(1))
    context_parallel_degree: int = option(
        1,
        "Context-parallel degree: every sequence is split over this many ranks (load-balanced, "
        "head-tail chunks), each rank attending with its queries to the K/V all-gathered over them; "
        "FSDP shards parameters over dp_shard x cp. training.seq_len must divide by 2 x this degree.",
        bounds=at_least(1),
    )
    expert_parallel_degree: int = option(
        1,
        "Expert-parallel degree (MoE models): every MoE layer's routed experts are split over this "
        "many ranks, each token sent to the rank holding its expert and back by all-to-all. EP "
        "borrows its ranks from FSDP's (it must divide data_parallel_shard_degree x "
        "context_parallel_degree); the experts are FSDP-sharded over the remaining ones.",
        bounds=at_least(1),
    )
    enable_sequence_parallel: bool = option(True, "Shard norms/activations along the sequence under TP.")
    disable_loss_parallel: bool = option(False, "Gather logits before the loss under TP.")
    enable_async_tensor_parallel: bool = option(
        False,
        "Async TP: overlap TP collectives with matmuls (inductor micro-pipelining); needs "
        "CUDA, compile.enable and tensor_parallel_degree > 1.",
    )
    pipeline_parallel_schedule: PipelineSchedule = option("1F1B", "Pipeline schedule.")
    pipeline_parallel_microbatch_size: int = option(1, "Sequences per pipeline micro-batch.", bounds=at_least(1))
    pipeline_parallel_split_points: list[str] = option(
        [], "Module names starting each stage after the first (e.g. layers.4); empty: even split."
    )
    fsdp_reshard_after_forward: ReshardPolicy = option(
        "default",
        "Free gathered params after forward ('default': yes, except the last group, and no group "
        "under pipeline parallel, as torchtitan).",
    )
    pipeline_fsdp_reduce: PipelineFsdpReduce = option(
        "per_step",
        "When a pipeline stage under FSDP reduce-scatters its gradients. 'per_step' (torch's "
        "pipelining, as torchtitan runs it): every microbatch's backward keeps the stage's gathered "
        "parameters and accumulates its unsharded gradients in the reduce dtype; one reduce-scatter "
        "per step. 'per_microbatch': each microbatch's backward frees the gathered parameters and "
        "reduce-scatters its gradients into the sharded ones: a stage's unsharded gradients "
        "(4 bytes a parameter with fp32 reduce) are never held across microbatches, at the cost "
        "of one reduce-scatter per microbatch and one all-gather per microbatch's forward.",
    )
    backend: Literal["auto", "gloo", "nccl"] = option(
        "auto", "Process-group backend: 'auto' is nccl on CUDA, gloo on CPU."
    )
    ddp_bucket_cap_mb: float = option(
        25.0,
        "DDP gradient bucket size in MiB (torch's DistributedDataParallel default): each bucket's "
        "all-reduce starts as soon as its gradients are ready, overlapping the rest of backward "
        "(step times by size: docs/performance.md).",
        bounds=above(0),
    )


@dataclass
class CheckpointConfig:
    enable: bool = option(False, "Save and resume distributed checkpoints.")
    folder: str = option("checkpoint", "Checkpoint folder, under job.dump_folder.")
    interval: int = option(500, "Save every N steps (and at the last step).", bounds=at_least(1))
    keep_latest_k: int = option(
        0,
        "Keep only the newest K full checkpoints (0 keeps all); older ones are removed only "
        "after a newer one is complete. Seed checkpoints and model-only exports are kept.",
        bounds=at_least(0),
    )
    load_step: int = option(
        -1, "Step to resume from (-1: newest complete checkpoint).", bounds=at_least(0, also={-1: "newest"})
    )
    initial_load_path: str = option(
        "",
        "Weights to start from when the folder holds no checkpoint: a step folder (seed, full "
        "or model-only export), a folder of them, or a Hugging Face Llama folder (config.json + "
        "*.safetensors; config.json must match model.flavor and the tokenizer's vocab). Loads the "
        "model only; training starts at step 0.",
    )
    last_save_model_only: bool = option(
        False,
        "At the last step write only the model, as one torch.save file in export_dtype "
        "(step-N/model.pt): an export, not a resume point.",
    )
    last_save_hf: bool = option(
        False,
        "After the last step's save, also convert it into a Hugging Face Llama folder "
        "<checkpoint folder>/hf-step-N (safetensors in export_dtype, 5 GB shards + index, "
        "config.json, the run's tokenizer files); the same as `python -m torchtitan_amp.checkpoint "
        "export --format hf`.",
    )
    export_dtype: DtypeName = option("float32", "Dtype of model-only and Hugging Face exports.")
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = option(
        "disabled",
        "'async' writes checkpoints in a background thread after a synchronous copy; "
        "'async_with_pinned_mem' (CUDA only) stages through pinned host memory.",
    )
    exclude_from_loading: list[str] = option(
        [],
        "States not to restore on load, from: model, optimizer, lr_scheduler, scaler, diloco, "
        "train_state, dataloader, rng, validation.",
    )
    create_seed_checkpoint: bool = option(
        False,
        "Initialise the model, save it as step-0 (model only) and exit; run on one process. "
        "Every parallel layout can start from it.",
    )
    preemption_warning_s: int = option(
        0,
        "Seconds from the pre-emption signal to the hard kill (SLURM's --signal=B:USR1@N, "
        "docker stop -t N); 0: not known, no check. When set, start-up warns if a step plus a save "
        "(estimated from this rank's checkpoint size and a timed 64 MiB write) would not fit, and "
        "so does a measured step plus save later. scripts/multinode_trainer.slurm sets it.",
        bounds=at_least(0, note="0: unknown"),
    )
    checksums: bool = option(
        True,
        "Record a CRC-32 of every checkpoint file at save and verify them before loading "
        "(ranks split the files); a corrupt checkpoint is named and the previous one loaded. "
        "false: check file sizes only.",
    )


@dataclass
class ValidationConfig:
    enable: bool = option(False, "Evaluate the loss on a validation set during training (and at the last step).")
    dataset: str = option(
        "",
        "Any form training.dataset takes; '' evaluates on the training data itself (no held-out "
        "split: the log says so).",
    )
    freq: int = option(500, "Evaluate every N steps (and after the last step).", bounds=at_least(1))
    steps: int = option(
        -1,
        "Batches per evaluation: -1 evaluates the whole split once (every rank's full batches); N "
        "continues through the split from where the previous evaluation stopped (the position is "
        "checkpointed).",
        bounds=at_least(1, also={-1: "the whole split"}),
    )
    local_batch_size: int = option(
        0,
        "Sequences per evaluation batch per data-parallel rank (0: training's).",
        bounds=at_least(1, also={0: "training's"}),
    )
    seq_len: int = option(
        0, "Tokens per evaluation sequence (0: training's).", bounds=at_least(2, also={0: "training's"})
    )
    sample_prompts: list[str] = option(
        [],
        "Prompts whose continuations every evaluation generates and writes to the log, "
        "samples.jsonl and TensorBoard text (docs/generation.md); on the command line comma-separated. "
        "Not with pipeline or context parallel.",
    )
    sample_max_new_tokens: int = option(
        32, "Tokens generated per sample prompt (fewer if EOS comes first).", bounds=at_least(1)
    )
    sample_temperature: float = option(
        0.0,
        "Sampling temperature of the sample prompts: 0 is greedy; above 0 draws from the softmax, "
        "seeded with training.seed at every evaluation.",
        bounds=at_least(0, note="0: greedy"),
    )


@dataclass
class MetricsConfig:
    log_freq: int = option(10, "Log every N steps (and at step 1).", bounds=at_least(1))
    enable_tensorboard: bool = option(False, "Write TensorBoard scalars.")
    save_tb_folder: str = option("tb", "TensorBoard folder, under job.dump_folder.")
    enable_wandb: bool = option(
        False,
        "Log to Weights & Biases too (rank 0; with TensorBoard or alone): scalars, the job config "
        "and the precision report, under job.dump_folder/wandb/. Offline unless logged in (WANDB_API_KEY "
        "or a netrc entry); WANDB_MODE overrides. A run resumed in the same dump folder appends to its W&B run.",
    )
    wandb_project: str = option(
        "",
        "W&B project (empty: $WANDB_PROJECT, else 'torchtitan_amp').",
        bounds=Text(max_len=128, forbidden=WANDB_PROJECT_FORBIDDEN),
    )
    wandb_entity: str = option("", "W&B entity, user or team (empty: $WANDB_ENTITY, else your default).")
    wandb_run_name: str = option("", "W&B run name (empty: the dump folder's name).")
    wandb_tags: list[str] = option(
        [], "W&B run tags (comma-separated on the command line).", bounds=Text(min_len=1, max_len=64, each="tag")
    )


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective"] = option("none", "Recompute activations in backward.")
    selective_ac_option: str = option(
        "2", "With mode=selective: an integer N (every N-th block) or 'op' (op-level save list)."
    )
    per_op_sac_save_mm: Literal["alternate", "all"] = option(
        "alternate",
        "With selective_ac_option='op', which matmul outputs a block keeps: 'alternate' (torchtitan's "
        "rule: the 1st, 3rd, 5th... mm of each checkpointed region, the others recomputed) or 'all' "
        "(every one: more memory, less recompute).",
    )


@dataclass
class CompileConfig:
    enable: bool = option(False, "torch.compile each transformer block.")


@dataclass
class MixedPrecisionConfig:
    enabled: BoolOrAuto = option(
        "auto",
        "Train in mixed precision (false: fp32 everywhere). 'auto': yes on GPUs and on CPUs whose "
        "param_dtype matmul is native (timed at start-up), fp32 where the CPU emulates it "
        "(docs/performance.md); the start-up log and precision_report.json say what was decided.",
    )
    param_dtype: DtypeName = option("bfloat16", "Compute dtype of lower-precision-safe modules.")
    reduce_dtype: DtypeName = option("float32", "Dtype of gradients on the wire.")
    output_dtype: DtypeName = option("float32", "Dtype of the model's outputs (logits).")
    router_dtype: Literal["float32", "float64", "bfloat16"] = option(
        "float32",
        "Mixture of experts: dtype of the router's logits, scores, top-k choice and combine "
        "weights (Megatron's moe_router_dtype). A rounded score flips which expert a token goes to: "
        "bfloat16 rounds the most, float64 the least (docs/moe.md).",
    )
    cp_reduce_dtype: DtypeName = option(
        "float32",
        "Context parallel: dtype in which the key/value gradients of the cp ranks are "
        "summed (the reduce-scatter behind the K/V all-gather). fp32 rounds once after the sum; "
        "bfloat16 halves those bytes and rounds at every partial sum, an error growing with the cp degree.",
    )
    lower_precision_safe_modules: list[str] = option(
        ["torch.nn.Linear"],
        "Module classes whose compute/gathers/gradients may use param/reduce dtype; others stay fp32.",
    )
    fp32_module_names: list[str] = option(
        [],
        "fnmatch patterns of module names kept in fp32 on every path, e.g. 'output,layers.0.*' "
        "(a block's name covers everything in it); a pattern naming no module is an error.",
    )
    init_scale: float = option(65536.0, "fp16 loss scaling: initial scale.", bounds=above(0))
    growth_factor: float = option(2.0, "fp16 loss scaling: growth factor.", bounds=above(1))
    backoff_factor: float = option(
        0.5, "fp16 loss scaling: back-off factor on overflow.", bounds=between(0, 1, low_open=True, high_open=True)
    )
    growth_interval: int = option(2000, "fp16 loss scaling: overflow-free steps before growing.", bounds=at_least(1))
    fp8: Literal["none", "tensorwise", "rowwise"] = option(
        "none",
        "float8 training of nn.Linear through torchao (its recipe names): 'tensorwise' "
        "(fastest) or 'rowwise' (more accurate); needs torchao and a device with fp8 matmuls.",
    )
    fp8_skip_modules: list[str] = option(
        ["output"],
        "fnmatch patterns of Linear module names kept out of fp8 (Linears whose sizes "
        "are not multiples of 16 are always kept out).",
    )
    fp8_all_gather: bool = option(
        False, "fp8 = 'tensorwise' on the FSDP path: all-gather the weights in fp8 (half of bf16's bytes)."
    )
    block_scaled: Literal["none", "mxfp8", "nvfp4"] = option(
        "none",
        "Block-scaled training of nn.Linear (torchao's names): 'mxfp8' (OCP MX: e4m3 in blocks "
        "of 32, E8M0 scales) or 'nvfp4' (e2m1 in blocks of 16, e4m3 scales, an fp32 tensor scale); all "
        "three matmuls of each converted Linear. Not with fp8.",
    )
    block_scaled_emulate: BoolOrAuto = option(
        "auto",
        "true: quantize bit-exactly and multiply in fp32 on any device (slower than bf16); "
        "'auto': the device's block-scaled kernels, refused where it has none; false: kernels only.",
    )
    mxfp8_scale_mode: Literal["floor", "rceil"] = option(
        "rceil",
        "mxfp8 block scale rule: 'rceil' (the training recipes': torchao's MXFP8 default, TransformerEngine, "
        "cuBLAS; rounds the scale up, no element clipped) or 'floor' (the OCP spec's rule; a block's largest "
        "element can exceed 448 and is clamped to it).",
    )
    nvfp4_weight_2d: bool = option(
        True, "nvfp4: one scale per 16x16 weight tile (forward and dgrad see one quantized W)."
    )
    nvfp4_rht: bool = option(True, "nvfp4: random Hadamard transform (16x16) of both weight-gradient operands.")
    nvfp4_stochastic_rounding: bool = option(
        True, "nvfp4: round the gradient operands of dgrad and wgrad stochastically (seeded by training.seed)."
    )
    block_scaled_experts: bool = option(
        False,
        "With block_scaled: the routed experts' grouped GEMMs (MoE models) run in the same format, "
        "per expert (torchtitan: quantize.grouped_mm.mx.fqns = ['experts']); false keeps them in the plan's "
        "compute dtype. The router and the shared expert's gates are not grouped experts.",
    )
    block_scaled_skip_modules: list[str] = option(
        ["output"],
        "fnmatch patterns of Linear names kept out of block_scaled (in the plan's compute dtype); "
        "a pattern naming no Linear is an error.",
    )
    block_scaled_edge_layers: int = option(
        1,
        "The first and the last N transformer blocks stay out of block_scaled (NVIDIA's NVFP4 recipe "
        "keeps a few edge blocks in bf16).",
        bounds=at_least(0, note="0: convert every block"),
    )
    audit: bool = option(
        False,
        "Instead of training: run one step of this job with dtype recorders on, write "
        "precision_audit.json and exit 1 if anything ran or moved in another dtype than this plan "
        "promises (torchtitan_amp/precision/audit.py).",
    )


@dataclass
class DryRunConfig:
    world_size: int = option(
        -1,
        "Ranks to simulate with job.dry_run (-1: the product of the parallel degrees, counting "
        "data_parallel_shard_degree = -1 as 1).",
        bounds=at_least(1, also={-1: ""}),
    )
    rank: int = option(0, "The rank whose memory and traffic job.dry_run reports.", bounds=at_least(0))
    vocab_size: int = option(
        0,
        "Vocabulary size for job.dry_run (0: the tokenizer's; e.g. 128256 to size a run that "
        "will use Llama 3's tokenizer).",
        bounds=at_least(0, note="0: the tokenizer's"),
    )
    device: Literal["cuda", "cpu"] = option(
        "cuda",
        "The device job.dry_run sizes the job for, whatever machine runs the dry run: 'cuda' "
        "(backend nccl) sizes fp8, fp8 all-gather and the other GPU-only options a GPU run takes; 'cpu' "
        "(gloo) refuses them as a CPU run would.",
    )


@dataclass
class ProfilingConfig:
    enable_profiling: bool = option(False, "Write torch.profiler traces (Chrome JSON) every profile_freq steps.")
    profile_freq: int = option(10, "Steps between traces; each trace records one step after one warm-up step.")
    save_traces_folder: str = option("profile_traces", "Trace folder, under job.dump_folder.")
    enable_memory_snapshot: bool = option(False, "CUDA only: record allocator history, dump a snapshot at the end.")
    save_memory_snapshot_folder: str = option("memory_snapshot", "Snapshot folder, under job.dump_folder.")


@dataclass
class CommConfig:
    init_timeout_seconds: int = option(
        300, "Timeout for process-group start-up and the first step.", bounds=at_least(1)
    )
    timeout_seconds: int = option(
        600,
        "Timeout of every collective after the first step: a rank that died or hangs ends the "
        "job with an error after this long instead of blocking it forever.",
        bounds=at_least(1),
    )


@dataclass
class FaultToleranceConfig:
    enable: bool = option(
        False,
        "Train as one replica group of several under torchft (pip install torchtitan-amp[ft]): "
        "a lost group is left out of the step while the others go on, and rejoins by copying the "
        "weights of a live group. Each group is its own torchrun; torchft owns the replicate "
        "dimension (FSDP inside a group, torchft's all-reduce across groups). docs/fault_tolerance.md",
    )
    replica_id: int = option(
        0, "This group's index among the replica groups (0 .. group_size - 1).", bounds=at_least(0)
    )
    group_size: int = option(
        0,
        "How many replica groups the job has at most (torchtitan's name): the data is split over "
        "group_size x the data-parallel degree inside a group.",
        bounds=at_least(0, note="0: unset"),
    )
    min_replica_size: int = option(
        1, "Groups that must take part in a step for it to be committed.", bounds=at_least(1)
    )
    process_group: Literal["auto", "gloo", "nccl"] = option(
        "auto", "Backend of the cross-group all-reduce; 'auto': nccl where the job trains on CUDA, else gloo."
    )
    process_group_timeout_ms: int = option(
        60000,
        "A cross-group collective that has not finished after this long fails; the step is "
        "discarded and the next quorum leaves the lost group out. It must outlast a heal (the "
        "survivors' next collective waits for the healing group: its state bytes / transfer rate), "
        "docs/fault_tolerance.md.",
        bounds=at_least(1),
    )
    quorum_timeout_seconds: int = option(
        60, "How long a group waits for the lighthouse to form a quorum before failing.", bounds=at_least(1)
    )
    lighthouse: str = option(
        "",
        "Address of torchft's lighthouse, a URL http://HOST:PORT; empty: the TORCHFT_LIGHTHOUSE environment variable.",
        bounds=Text(max_len=256),
    )
    semi_sync_method: Literal["none", "diloco"] = option(
        "none",
        "'none': every step's gradients are averaged across groups; 'diloco': groups train "
        "alone and average their weight changes every sync_steps steps.",
    )
    sync_steps: int = option(
        5, "semi_sync_method = 'diloco': inner steps between syncs (and the last step syncs).", bounds=at_least(1)
    )
    outer_lr: float = option(
        0.7,
        "semi_sync_method = 'diloco': the outer optimizer's (Nesterov SGD) learning rate, "
        "applied to the groups' mean pseudo-gradient at each sync (torchtitan's 0.7).",
        bounds=above(0),
    )
    outer_momentum: float = option(
        0.9,
        "semi_sync_method = 'diloco': the outer optimizer's Nesterov momentum (torchtitan's 0.9).",
        bounds=between(0, 1, high_open=True),
    )
    pseudo_gradient_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "semi_sync_method = 'diloco': the dtype the pseudo-gradients (global weights - local "
        "weights, computed in fp32) cross the groups in; bfloat16 halves a sync's bytes and rounds each "
        "group's pseudo-gradient once. The global weights and the outer momentum stay float32.",
    )
    max_retries: int = option(
        -1,
        "Steps in a row this group may fail to commit (a cross-group all-reduce failed) before it "
        "gives up with an error, so that its launcher restarts it and it heals; torchft's name. "
        "-1: never give up.",
        bounds=at_least(0, also={-1: "never give up"}),
    )


@dataclass
class DebugConfig:
    """[debug]: switches for testing the job itself; none of them belongs in a real run."""

    fault_inject_at_step: int = option(
        0,
        "Rank fault_inject_rank exits hard (os._exit(1)) after step N, once per dump folder (a marker "
        "file there records it), to test restarts and resumes.",
        bounds=at_least(0, note="0: off"),
    )
    fault_inject_rank: int = option(0, "The rank that fault_inject_at_step kills.")


@dataclass
class JobConfig:
    job: JobSectionConfig = field(default_factory=JobSectionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    # "section.key" of every field set by TOML or CLI -> where it was last set ("toml" or "cli"):
    # an alias and its canonical name conflict only within one source; across sources the usual
    # precedence (CLI > TOML) applies.
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def explicit(self) -> set[str]:
        """Every field set by TOML or CLI (not left at its default), as "section.key"."""
        return set(self.sources)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in section_names()}


def section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(JobConfig) if f.name != "sources"]
