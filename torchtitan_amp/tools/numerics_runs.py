"""The numerics matrix's runs (torchtitan_amp/tools/numerics_matrix.py trains them): the parallel
layouts and precisions, the combinations left out and why, the named presets, which runs a
selection trains, and each run's training arguments."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field

SHARD = "--parallelism.data_parallel_shard_degree"
REPLICATE = "--parallelism.data_parallel_replicate_degree"
TP = "--parallelism.tensor_parallel_degree"
PP = "--parallelism.pipeline_parallel_degree"
CP = "--parallelism.context_parallel_degree"
EP = "--parallelism.expert_parallel_degree"
MOE = ("--model.name", "moe", "--model.flavor", "debugmodel_moe")
MOE_PRECISIONS = ("fp32", "bf16", "bf16 + bf16 router")
# The model families beside Llama, each on its debug shape, one process: bf16 against fp32, and
# for the routed ones bf16 with a bf16 router.
FAMILY_ROWS = (
    ("Qwen3", "qwen3", ("fp32", "bf16")),
    ("DeepSeek-V3", "deepseek_v3", MOE_PRECISIONS),
    ("gpt-oss", "gpt_oss", MOE_PRECISIONS),
)


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    nproc: int
    dp: int  # data-parallel degree: local batch = global batch / dp
    args: tuple[str, ...]
    cp: int = 1  # context-parallel degree (its ranks share each sequence, and FSDP shards over them)
    # The model, when not the --flavor Llama: its rows compare with the single layout of the same
    # model ("reference"), and run only the precisions named (None: all).
    model: tuple[str, ...] = ()
    reference: str = "single"
    precisions: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PrecisionSpec:
    name: str
    args: tuple[str, ...]
    needs_dp: bool = False  # only meaningful where gradients are reduced over data parallel ranks
    needs_cp: bool = False  # only meaningful under context parallel
    needs_moe: bool = False  # only meaningful for a model with routers
    # Low-precision GEMM rows (fp8, block-scaled): one process only, and only when --only or
    # --preset names them (the default matrix is layouts x the PyTorch-native precisions).
    opt_in: bool = False


LAYOUTS = (
    LayoutSpec("single", 1, 1, ()),
    LayoutSpec("DDP 2", 2, 2, (REPLICATE, "2", SHARD, "1")),
    LayoutSpec("FSDP 2", 2, 2, (SHARD, "2")),
    LayoutSpec("TP 2", 2, 1, (SHARD, "1", TP, "2")),
    LayoutSpec("PP 2", 2, 1, (SHARD, "1", PP, "2")),
    LayoutSpec("HSDP 2x2", 4, 4, (REPLICATE, "2", SHARD, "2")),
    LayoutSpec("FSDP 2 x TP 2", 4, 2, (SHARD, "2", TP, "2")),
    LayoutSpec("CP 2", 2, 1, (SHARD, "1", CP, "2"), cp=2),
    LayoutSpec("FSDP 2 x CP 2", 4, 2, (SHARD, "2", CP, "2"), cp=2),
    LayoutSpec("FSDP 2 x TP 2 x PP 2", 8, 2, (SHARD, "2", TP, "2", PP, "2")),
    LayoutSpec("HSDP 2x2 x TP 2", 8, 4, (REPLICATE, "2", SHARD, "2", TP, "2")),
    *(
        LayoutSpec(f"MoE {name}", nproc, dp, args, model=MOE, reference="MoE single", precisions=MOE_PRECISIONS)
        for name, nproc, dp, args in (
            ("single", 1, 1, ()),
            ("FSDP 2", 2, 2, (SHARD, "2")),
            ("EP 2", 2, 2, (SHARD, "2", EP, "2")),
            ("TP 2", 2, 1, (SHARD, "1", TP, "2")),
        )
    ),
    *(
        LayoutSpec(
            f"{label} single",
            1,
            1,
            (),
            model=("--model.name", name, "--model.flavor", "debugmodel"),
            reference=f"{label} single",
            precisions=precisions,
        )
        for label, name, precisions in FAMILY_ROWS
    ),
)

NATIVE_PRECISIONS = (
    PrecisionSpec("fp32", ("--mixed_precision.enabled", "false")),
    PrecisionSpec("bf16", ("--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.reduce_dtype", "float32")),
    PrecisionSpec(
        "bf16 + bf16 reduce",
        ("--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.reduce_dtype", "bfloat16"),
        needs_dp=True,
    ),
    PrecisionSpec(
        "fp16 + loss scaling", ("--mixed_precision.param_dtype", "float16", "--mixed_precision.reduce_dtype", "float32")
    ),
    PrecisionSpec("pure bf16", ("--training.dtype", "bfloat16", "--mixed_precision.enabled", "false")),
    PrecisionSpec(
        "bf16 + bf16 cp reduce",
        ("--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.cp_reduce_dtype", "bfloat16"),
        needs_cp=True,
    ),
    # Routers score, choose and weight in bf16 (the default routes in fp32 under any precision).
    PrecisionSpec(
        "bf16 + bf16 router",
        (
            "--mixed_precision.param_dtype",
            "bfloat16",
            "--mixed_precision.reduce_dtype",
            "float32",
            "--mixed_precision.router_dtype",
            "bfloat16",
        ),
        needs_moe=True,
    ),
)

BF16 = ("--mixed_precision.param_dtype", "bfloat16", "--mixed_precision.reduce_dtype", "float32")
BLOCK_SCALED = (*BF16, "--mixed_precision.block_scaled_emulate", "true", "--mixed_precision.block_scaled")
NVFP4 = (*BLOCK_SCALED, "nvfp4")
# The GEMM formats on top of bf16 (the Linears they leave out compute in bf16): torchao's fp8
# rowwise (torch._scaled_mm, which runs on CPU too), and the emulated block-scaled recipes with
# their defaults (output and the first and last block in bf16; nvfp4: NVIDIA's full recipe).
LOW_PRECISION_GEMMS = (
    PrecisionSpec("fp8 rowwise", (*BF16, "--mixed_precision.fp8", "rowwise"), opt_in=True),
    PrecisionSpec("mxfp8", (*BLOCK_SCALED, "mxfp8"), opt_in=True),
    PrecisionSpec("nvfp4", NVFP4, opt_in=True),
    PrecisionSpec("nvfp4, RHT off", (*NVFP4, "--mixed_precision.nvfp4_rht", "false"), opt_in=True),
    PrecisionSpec("nvfp4, SR off", (*NVFP4, "--mixed_precision.nvfp4_stochastic_rounding", "false"), opt_in=True),
    PrecisionSpec("nvfp4, 1x16 W", (*NVFP4, "--mixed_precision.nvfp4_weight_2d", "false"), opt_in=True),
)
PRECISIONS = (*NATIVE_PRECISIONS, *LOW_PRECISION_GEMMS)
# Named selections (--preset): an --only regex and the settings their docs table was measured with.
PRESETS = {
    "blockscaled": {
        "only": r"^single / (bf16|fp8 rowwise|mxfp8|nvfp4|nvfp4, RHT off|nvfp4, SR off)$",
        "help": "single process: bf16, fp8 rowwise, mxfp8, nvfp4 (full recipe, RHT off, SR off; "
        "'nvfp4, 1x16 W' by --only)",
    },
}

# Combinations left out, with the reason printed under the table. fp16 matmuls have no fast CPU
# kernel (~10x slower than fp32 at these sizes), so fp16 runs on the 2-process layouts only.
SKIPPED = {
    ("HSDP 2x2", "fp16 + loss scaling"): "fp16 is ~10x slower than fp32 on CPU; covered by FSDP 2 and DDP 2",
    ("FSDP 2 x TP 2", "fp16 + loss scaling"): "fp16 is ~10x slower than fp32 on CPU; covered by FSDP 2 and TP 2",
    ("TP 2", "pure bf16"): "one pure-bf16 run per family is enough: single, DDP 2, FSDP 2",
    ("PP 2", "pure bf16"): "one pure-bf16 run per family is enough: single, DDP 2, FSDP 2",
    ("HSDP 2x2", "pure bf16"): "one pure-bf16 run per family is enough: single, DDP 2, FSDP 2",
    ("FSDP 2 x TP 2", "pure bf16"): "one pure-bf16 run per family is enough: single, DDP 2, FSDP 2",
    ("CP 2", "pure bf16"): "one pure-bf16 run per family is enough: single, DDP 2, FSDP 2",
    ("FSDP 2 x CP 2", "pure bf16"): "one pure-bf16 run per family is enough: single, DDP 2, FSDP 2",
    ("FSDP 2 x CP 2", "fp16 + loss scaling"): "fp16 is ~10x slower than fp32 on CPU; covered by CP 2",
    **{
        (layout, prec): "8 processes on a few cores: the 3-D layouts run fp32 and bf16 only"
        for layout in ("FSDP 2 x TP 2 x PP 2", "HSDP 2x2 x TP 2")
        for prec in ("bf16 + bf16 reduce", "fp16 + loss scaling", "pure bf16")
    },
}


@dataclass
class Run:
    layout: LayoutSpec
    precision: PrecisionSpec

    @property
    def key(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", f"{self.layout.name} {self.precision.name}".lower()).strip("_")

    @property
    def label(self) -> str:
        return f"{self.layout.name} / {self.precision.name}"

    @property
    def reference(self) -> str:
        """The label of the run this one is compared with: its model's fp32 single process."""
        return f"{self.layout.reference} / fp32"


@dataclass
class Result:
    run: Run
    losses: dict[int, float] = field(default_factory=dict)
    path: str = ""
    skipped_steps: int = 0
    val_loss: float = math.nan  # after the last step
    router_dtype: str = ""  # models with routers: the plan's router_dtype
    error: str = ""
    wall_s: float = 0.0


def select_runs(max_procs: int, only: str | None) -> tuple[list[Run], list[str]]:
    """The runs --only matches, plus the fp32 single-process reference of each model they train."""
    candidates = []
    for layout in LAYOUTS:
        for prec in PRECISIONS:
            run = Run(layout, prec)
            # FSDP shards over the cp ranks too: a cp layout reduces gradients.
            if prec.needs_dp and layout.dp * layout.cp == 1 or prec.needs_cp and layout.cp == 1:
                continue
            if prec.needs_moe and not layout.model or prec.name not in (layout.precisions or (prec.name,)):
                continue
            if prec.opt_in and (layout.nproc > 1 or layout.model or not only or not re.search(only, run.label)):
                continue
            candidates.append(run)
    matched = {r.label for r in candidates if not only or re.search(only, r.label)}
    # Without --only (or when it matches nothing) the Llama reference runs, as it always has.
    wanted = (
        matched
        | {r.reference for r in candidates if r.label in matched}
        | ({"single / fp32"} if not matched else set())
    )
    runs, notes = [], []
    for run in candidates:
        layout, prec = run.layout, run.precision
        if run.label not in wanted:
            continue
        if (layout.name, prec.name) in SKIPPED:
            notes.append(f"{run.label}: not run ({SKIPPED[layout.name, prec.name]})")
            continue
        if layout.nproc > max_procs:
            notes.append(f"{run.label}: not run (needs {layout.nproc} processes, --max-procs {max_procs})")
            continue
        runs.append(run)
    return runs, notes


def train_args(run: Run, a: argparse.Namespace) -> list[str]:
    if a.global_batch % run.layout.dp:
        raise SystemExit(f"--global-batch {a.global_batch} is not divisible by {run.layout.name}'s dp degree")
    local_batch = str(a.global_batch // run.layout.dp)
    # One evaluation after the last step, of the same val_batches x global batch windows on every
    # layout (the bundled data has no held-out split: this is the loss on training windows).
    validation = (
        [
            "--validation.enable",
            "true",
            "--validation.freq",
            str(a.steps),
            "--validation.steps",
            str(a.val_batches),
            "--validation.local_batch_size",
            local_batch,
        ]
        if a.val_batches
        else []
    )
    model = list(run.layout.model) or ["--model.flavor", a.flavor]
    return [
        *model,
        "--training.seq_len",
        str(a.seq_len),
        "--training.local_batch_size",
        local_batch,
        "--training.steps",
        str(a.steps),
        "--training.seed",
        str(a.seed),
        "--optimizer.lr",
        str(a.lr),
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        *validation,
        *run.layout.args,
        *run.precision.args,
    ]
