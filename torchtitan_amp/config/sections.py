"""The job config's schema: one dataclass per TOML section (a Literal type is the allowed set), and
`JobConfig`, which holds them and remembers where each set field came from. This module holds the
sections of what the run is (job, model, optimizer, schedule, training, checkpoints, validation,
metrics, profiling, debug); hardware_sections.py those of how it maps onto hardware."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan_amp.config.bounds import Text, above, at_least, between
from torchtitan_amp.config.hardware_sections import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    DryRunConfig,
    FaultToleranceConfig,
    MixedPrecisionConfig,
    ParallelismConfig,
)
from torchtitan_amp.config.option import option
from torchtitan_amp.core.rules import DtypeName, family_names, flavor_names

# Fields that moved to another section: naming the old place is an error that says the new one.
MOVED_FIELDS = {
    "training.fault_inject_at_step": "debug.fault_inject_at_step",
    "training.fault_inject_rank": "debug.fault_inject_rank",
}
# Characters W&B refuses in a project name: refused here rather than by wandb.init after the
# model is built.
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


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
    attention_backend: Literal["auto", "sdpa", "flex"] = option(
        "auto",
        "'sdpa': scaled_dot_product_attention with a dense bool mask where the mask is not plain "
        "causal; 'flex': FlexAttention with block-sparse BlockMasks built once per batch (CUDA for "
        "training: torch has no FlexAttention backward on CPU); 'auto': flex on CUDA where the mask "
        "is not plain causal (documents, sliding windows, sinks), under context parallel too (over "
        "the gathered keys), SDPA otherwise and on CPU.",
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
        "held-out split) or 'chat:/file.jsonl' (conversations for fine-tuning, loss on assistant tokens; "
        "docs/post_training.md). See docs/data.md.",
    )
    chat_template: str = option(
        "",
        "The chat template of 'chat:' data and `generate --chat`: a shipped name ('byte', 'chatml') or "
        "a .jinja file, overriding the tokenizer's own; '' takes the tokenizer folder's (or, for the "
        "byte tokenizer, 'byte'). docs/post_training.md.",
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
        "model only; training starts at step 0. Loaded with checkpoint.enable = false too (then "
        "the run's own folder is neither read nor written).",
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
class ProfilingConfig:
    enable_profiling: bool = option(False, "Write torch.profiler traces (Chrome JSON) every profile_freq steps.")
    profile_freq: int = option(10, "Steps between traces; each trace records one step after one warm-up step.")
    save_traces_folder: str = option("profile_traces", "Trace folder, under job.dump_folder.")
    enable_memory_snapshot: bool = option(False, "CUDA only: record allocator history, dump a snapshot at the end.")
    save_memory_snapshot_folder: str = option("memory_snapshot", "Snapshot folder, under job.dump_folder.")


@dataclass
class LoraConfig:
    """[lora]: low-rank adapters on frozen base Linears (LoRA; QLoRA with quantize_base = "nf4")."""

    enable: bool = option(False, "Train low-rank adapters on the target Linears; every base parameter is frozen.")
    rank: int = option(8, "Adapter rank r: A is [r, in_features], B is [out_features, r].", bounds=at_least(1))
    alpha: float = option(16.0, "Adapter scaling numerator: the update is (alpha / rank) * B @ A.", bounds=above(0))
    dropout: float = option(0.0, "Dropout on the adapter's input (the input of A); 0: none.", bounds=between(0, 1))
    target_modules: list[str] = option(
        ["layers.*.attention.wq", "layers.*.attention.wv"],
        "fnmatch patterns of the nn.Linear module names that get adapters (e.g. 'layers.*.attention.wq'); "
        "a pattern matching nothing, or a match that is not an nn.Linear, is an error.",
    )
    quantize_base: Literal["none", "nf4", "fp8"] = option(
        "none",
        "'none': frozen base weights stored in the plan's compute dtype of the Linears (param_dtype in "
        "mixed precision, else fp32); 'nf4': QLoRA, the target Linears' base weights stored as torchao "
        "NF4Tensor (dequantized to the compute dtype for each matmul); 'fp8': the target Linears' base "
        "weights stored float8_e4m3fn with one fp32 scale per output row (amax / 448), dequantized to the "
        "compute dtype for each matmul (weight-only: the matmul runs in the compute dtype).",
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
    lora: LoraConfig = field(default_factory=LoraConfig)
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
