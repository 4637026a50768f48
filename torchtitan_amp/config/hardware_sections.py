"""The job config's sections for how a run maps onto hardware: parallelism degrees, activation
checkpointing, compile, mixed precision, the dry run, communication and fault tolerance (one
dataclass per TOML section; a Literal type is the allowed set). The run's other sections and
`JobConfig`, which holds them all, are in sections.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan_amp.config.bounds import Text, above, at_least, between
from torchtitan_amp.config.option import BoolOrAuto, option
from torchtitan_amp.core.rules import DtypeName, PipelineFsdpReduce, PipelineSchedule, ReshardPolicy


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
