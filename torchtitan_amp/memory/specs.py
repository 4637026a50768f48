"""What the accounting is told, as plain data: the precision plan's decisions (PrecisionSpec), the
layout (Layout), and the shapes a model family describes for it: its parameters per pipeline stage
(ParamSpec, Stage) and its saved-for-backward bytes per token (ActivationTerms). A precision plan
becomes a PrecisionSpec in precision/memory_spec.py, told the family's norm class (the "norm" kind
of the safe-module list).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torchtitan_amp.core.rules import DTYPE_BYTES, STAGES_PER_RANK, ReshardPolicy, stage_ids


def nf4_bytes(numel: int, itemsize: int, block: int = 64, scaler_block: int = 256) -> int:
    """torchao's NF4Tensor of `numel` weights quantized from a dtype of `itemsize` bytes: 4-bit codes,
    one int8 scale per block of 64, one factor per scaler block of scales (256, or the largest
    power of two dividing a small weight's scale count: precision/lora.py's nf4_blocks), the
    scales' mean and the 16-entry code table, those three in the weight's dtype.

    Args:
        numel: the weight's elements.
        itemsize: bytes per element of the dtype it was quantized from.
        block: weights per absmax scale.
        scaler_block: scales per double-quantization factor, at most (halved until it divides).
    """
    scales = numel // block
    while scales % scaler_block:
        scaler_block //= 2
    return numel // 2 + scales + itemsize * (scales // scaler_block + 1 + 16)


@dataclass(frozen=True)
class PrecisionSpec:
    """What the precision plan decided, as names (precision.memory_spec.from_plan builds it)."""

    path: str = "fsdp"  # "fsdp" | "autocast" | "full"
    storage: str = "float32"  # parameters, gradients and AdamW state
    param: str = "bfloat16"  # compute / all-gather dtype of lower-precision-safe modules
    reduce: str = "float32"  # gradient-reduce dtype of safe modules
    output: str = "float32"  # logits
    comm_hook: bool = False  # DDP compress hook (autocast path, reduce != fp32)
    # Module kinds in lower_precision_safe_modules: "linear" (incl. the output head), "embedding",
    # "norm". Everything else computes, gathers and reduces in fp32.
    safe_kinds: frozenset[str] = frozenset({"linear"})
    optimizer_state: str = ""  # AdamW's moments ("": the storage dtype)
    frozen: tuple[str, ...] = ()  # training.freeze patterns (module names)
    cp_reduce: str = "float32"  # context parallel: the K/V gradients' reduce-scatter
    router: str = "float32"  # MoE routing arithmetic (mixed_precision.router_dtype)
    # [lora]: every base parameter frozen; each target Linear (fnmatch over module names) gains
    # adapters of lora_rank x (in + out) trained elements in storage dtype; lora_nf4: the target
    # base weights are NF4 (nf4_bytes), not their compute dtype; lora_fp8: float8_e4m3fn, 1 byte a
    # weight plus one fp32 scale per output row
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_nf4: bool = False
    lora_fp8: bool = False

    @classmethod
    def simple(
        cls,
        path: str,
        param: str = "bfloat16",
        reduce: str = "float32",
        storage: str = "float32",
        comm_hook: bool = False,
    ) -> PrecisionSpec:
        """A spec from the plan's main dtypes, every other field at its default (no lower-precision
        exceptions, fp32 cp reduce and router, nothing frozen).

        Args:
            path: the precision path: "fsdp" (FSDP's mixed-precision policy), "autocast" or "full"
                (one dtype everywhere).
            param: the dtype parameters compute in (mixed_precision.param_dtype).
            reduce: the dtype gradients are reduced in (mixed_precision.reduce_dtype).
            storage: the dtype parameters, gradients and optimizer state are stored in
                (training.dtype).
            comm_hook: whether DDP compresses gradients with a comm hook (autocast path with a
                reduce dtype below fp32).
        """
        return cls(
            path,
            storage,
            param if path != "full" else storage,
            reduce if path != "full" else storage,
            "float32" if path != "full" else storage,
            comm_hook,
            cp_reduce="float32" if path != "full" else storage,
        )

    def low(self, kind: str) -> bool:
        """Whether modules of this kind run (and communicate) in param/reduce dtype."""
        return self.path != "full" and kind in self.safe_kinds

    @property
    def state(self) -> str:
        return self.optimizer_state or self.storage

    def is_frozen(self, param_name: str) -> bool:
        """training.freeze matches a module; everything inside it is frozen (everything under LoRA)."""
        if self.lora_rank:
            return True
        parts = param_name.split(".")[:-1]
        modules = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(m, pat) for m in modules for pat in self.frozen)

    def lora_target(self, spec: ParamSpec) -> bool:
        """A Linear weight that LoRA adapts (its module name matches lora_targets)."""
        module = spec.name.removesuffix(".weight")
        return (
            bool(self.lora_rank)
            and spec.name.endswith(".weight")
            and spec.kind == "linear"
            and (any(fnmatch.fnmatchcase(module, pat) for pat in self.lora_targets))
        )

    def stored(self, spec: ParamSpec) -> str:
        """A parameter's storage dtype: frozen ones keep their compute dtype (PrecisionPlan.frozen_dtype)."""
        if self.is_frozen(spec.name) and self.low(spec.kind):
            return self.param
        return self.storage

    def bytes_per_param(self) -> dict[str, int]:
        """Bytes per trained parameter held in parameters, gradients and AdamW moments (summed
        over data-parallel shards: divide by dp_shard for one FSDP rank), and per frozen one."""
        s, m = DTYPE_BYTES[self.storage], DTYPE_BYTES[self.state]
        return {
            "param": s,
            "grad": s,
            "optimizer": 2 * m,
            "trained_total": 2 * s + 2 * m,
            "frozen_linear": DTYPE_BYTES[self.param if self.low("linear") else self.storage],
        }

    @property
    def residual(self) -> str:
        """dtype of the residual stream between blocks (what PP sends and TP gathers)."""
        if self.path == "fsdp":
            return self.param  # each block's input is cast to param dtype (cast_block_inputs)
        return self.storage  # autocast: fp32 residual (bf16 matmul outputs promote on add)

    @property
    def compute(self) -> str:
        """dtype of the matmul outputs inside a block."""
        return self.param if self.low("linear") else self.storage


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    seq_len: int = 2048
    local_batch_size: int = 1
    grad_accum: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    ac_mode: str = "none"  # "none" | "full" | "selective"
    ac_option: str = "2"  # selective: every N-th block, or "op"
    op_sac_save_mm: str = "alternate"  # op-level SAC's matmul outputs kept: "alternate" | "all"
    reshard_after_forward: ReshardPolicy = "default"
    split_points: tuple[int, ...] = ()  # first layer of each stage after the first
    cp: int = 1  # context parallel: each rank holds seq_len / cp tokens of every window
    attn_mask_type: str = "causal"  # "causal" | "block_causal" (model.attn_mask_type)
    attention_backend: str = "sdpa"  # the plan's: "flex" builds BlockMasks, no [S, S] bool mask
    ep: int = 1  # expert parallel: routed experts split over ep of the dp_shard x cp ranks
    pp_fsdp_reduce: str = "per_step"  # "per_step" | "per_microbatch" (parallelism.pipeline_fsdp_reduce)
    # fault_tolerance.group_size when on: groups whose gradients torchft averages (1: off)
    replica_groups: int = 1
    # fault_tolerance DiLoCo: steps between the groups' pseudo-gradient syncs (0: gradients every step)
    sync_steps: int = 0

    @property
    def cross_group_every_step(self) -> bool:
        """torchft all-reduces gradients across replica groups every step (not under DiLoCo)."""
        return self.replica_groups > 1 and not self.sync_steps

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards parameters over: dp_shard x cp (ParallelDims.fsdp_shard)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards the EP-split experts over (ParallelDims.efsdp)."""
        return self.fsdp_shard // self.ep

    def fsdp_rank(self, dp_shard_rank: int, cp_rank: int) -> int:
        """A rank's index among FSDP's shards: the mesh flattens (dp_shard, cp) row-major."""
        return dp_shard_rank * self.cp + cp_rank

    @property
    def local_seq_len(self) -> int:
        """Tokens of each window on this rank (context parallel splits every window)."""
        return self.seq_len // self.cp

    @property
    def masked(self) -> bool:
        """Whether attention gets an explicit [B, 1, S/cp, S] bool mask (block_causal) instead of
        a causal flag (SDPA's is_causal; under CP each query chunk's lower-right causal bias).
        FlexAttention's BlockMask holds (S/128)^2 block indices per batch row, no [S, S] term."""
        return self.attn_mask_type != "causal" and self.attention_backend != "flex"

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    @property
    def ac_label(self) -> str:
        """The AC mode as reports print it: "none", "full" or "selective(<option>)"."""
        return f"selective({self.ac_option})" if self.ac_mode == "selective" else self.ac_mode

    @property
    def num_stages(self) -> int:
        return self.pp * STAGES_PER_RANK[self.pp_schedule] if self.pp > 1 else 1

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per schedule step (1 without PP)."""
        return self.local_batch_size // self.pp_microbatch_size if self.pp > 1 else 1

    @property
    def microbatch_tokens(self) -> int:
        """Tokens in one forward pass of this rank's model (its seq_len / cp of each window)."""
        return (self.pp_microbatch_size if self.pp > 1 else self.local_batch_size) * self.local_seq_len

    @property
    def microbatch_sequences(self) -> int:
        return self.pp_microbatch_size if self.pp > 1 else self.local_batch_size

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank holding a stage (looped placement)."""
        return stage % self.pp if self.pp > 1 else 0

    def stage_ids(self, pp_rank: int) -> list[int]:
        """Stages held by a pipeline rank: rank r holds r, r + pp, ... (looped placement)."""
        return stage_ids(pp_rank, self.pp, self.pp_schedule) if self.pp > 1 else [0]


@dataclass(frozen=True)
class Stage:
    index: int
    layers: range
    first: bool
    last: bool


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "embedding" | "linear" | "norm"
    tp_dim: int | None  # dim sharded by TP (None: replicated)
    block: int | None  # layer index, None for the ends
    # A routed expert weight [E, ...]: under EP dim 0 is split over ep, and FSDP shards dim 1 over
    # efsdp in a group of its own (parallelize.shard_ep_experts); without EP it is a Linear's.
    expert: bool = False


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes per token of one microbatch (multiply by microbatch tokens)."""

    layer: float  # one block, nothing recomputed
    layer_checkpointed: float  # one block under full AC: its input only
    layer_op_sac: float  # one block under op-level selective AC
    head: float  # final norm, output head, logits and loss (last stage)
    embedding: float  # token ids (first stage)
    stage: float = 0.0  # held once by every stage's forward: the attention mask, per-token rope tables
    # Per layer, what CPU's attention saves beyond CUDA's (it builds the causal bias as a mask;
    # it takes grouped K/V in fp32 only, CUDA's flash kernel in 16 bits): the planner sizes GPUs
    # without it, a measurement on this machine adds it (negative where CPU saves less).
    layer_cpu: float = 0.0
    # Blocks that differ (an MoE model's dense first blocks): layer index -> its `layer` bytes.
    layer_by_index: tuple[tuple[int, float], ...] = ()
    # The same for `layer_op_sac` (an MoE model's dense blocks save their MLP's matmul outputs).
    op_sac_by_index: tuple[tuple[int, float], ...] = ()

    def layer_at(self, index: int) -> float:
        return dict(self.layer_by_index).get(index, self.layer)

    def op_sac_at(self, index: int) -> float:
        return dict(self.op_sac_by_index).get(index, self.layer_op_sac)
