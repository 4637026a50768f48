"""The precision audit: one real step with recorders on, checked against the plan.

It passes on every layout x precision of the numerics matrix that a 2-core CPU runs in seconds
(single, DDP 2, FSDP 2, TP 2, PP 2, HSDP 2x2, FSDP 2 x TP 2, CP 2, FSDP 2 x CP 2; bf16, bf16
reduce, fp32, pure bf16, fp16 on DDP, fp8 on single, DDP, FSDP, TP and PP, emulated nvfp4 on DDP,
FSDP, TP and PP, emulated mxfp8 on DDP, FSDP and TP; single-process block-scaled audits are in
test_blockscaled_train.py), and each deliberate breach is caught by name: a Linear run in fp32, an
RMSNorm run in bf16, logits reaching the loss in bf16, FSDP reducing every gradient in fp32, context
parallel summing K/V gradients in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.launch import launch_worker, run_python
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.train import trainer as trainer_module

pytestmark = [pytest.mark.dist, pytest.mark.oldest_torch]

# The smallest flavor: the audit checks dtypes, not sizes, and CPUs without native bf16 emulate it
# at tens of times fp32's cost. Its 4 blocks still give PP 2 a block per stage, its 2 heads split
# over TP 2.
BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
]
BF16 = ["--mixed_precision.enabled", "true"]  # bf16 on every CPU kind: the audit's subject
MOE = ["--model.name", "moe", "--model.flavor", "debugmodel_moe"]  # later flavor arguments win
PRECISIONS = {
    "bf16": BF16,
    "bf16_reduce": [*BF16, "--mixed_precision.reduce_dtype", "bfloat16"],
    "fp32": ["--mixed_precision.enabled", "false"],
    "pure_bf16": ["--mixed_precision.enabled", "false", "--training.dtype", "bfloat16"],
    "fp16": ["--mixed_precision.param_dtype", "float16", "--mixed_precision.reduce_dtype", "float16"],
    "fp8": [*BF16, "--mixed_precision.fp8", "tensorwise"],
    # Per-module override by name: the head and the first block stay fp32.
    "fp32_names": [
        *BF16,
        "--mixed_precision.reduce_dtype",
        "bfloat16",
        "--mixed_precision.fp32_module_names",
        "output,layers.0",
    ],
    # LoRA: the base frozen in bf16, fp32 adapters whose gradients alone cross, in reduce_dtype.
    "lora": [*BF16, "--mixed_precision.reduce_dtype", "bfloat16", "--lora.enable"],
    # Frozen modules in bf16: no gradient, so nothing of theirs on the wire.
    "frozen": [
        *BF16,
        "--mixed_precision.reduce_dtype",
        "bfloat16",
        "--training.freeze",
        "tok_embeddings,layers.0,layers.1.attention",
    ],
    # Block-scaled, emulated: blocks 1-2 in nvfp4 (full recipe), the rest bf16.
    "nvfp4": [*BF16, "--mixed_precision.block_scaled", "nvfp4", "--mixed_precision.block_scaled_emulate", "true"],
    "mxfp8": [*BF16, "--mixed_precision.block_scaled", "mxfp8", "--mixed_precision.block_scaled_emulate", "true"],
}
SHARD, REPLICATE = "--parallelism.data_parallel_shard_degree", "--parallelism.data_parallel_replicate_degree"
TP, PP = "--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree"
CP = "--parallelism.context_parallel_degree"  # seq_len 32: divisible by 2 x cp
LAYOUTS = {
    "ddp": (
        2,
        [REPLICATE, "2", SHARD, "1"],
        ("bf16", "bf16_reduce", "fp32", "fp16", "fp8", "fp32_names", "frozen", "lora", "nvfp4", "mxfp8"),
    ),
    "fsdp": (
        2,
        [SHARD, "2"],
        ("bf16", "bf16_reduce", "fp32", "pure_bf16", "fp8", "fp32_names", "frozen", "lora", "nvfp4", "mxfp8"),
    ),
    "tp": (2, [TP, "2", SHARD, "1"], ("bf16", "fp32", "fp8", "fp32_names", "frozen", "nvfp4", "mxfp8")),
    "pp": (2, [PP, "2", SHARD, "1"], ("bf16", "fp32", "fp8", "fp32_names", "frozen", "lora", "nvfp4")),
    "hsdp": (4, [REPLICATE, "2", SHARD, "2"], ("bf16_reduce",)),
    "fsdp_tp": (4, [SHARD, "2", TP, "2"], ("bf16",)),
    # cp alone: FSDP shards over the cp ranks themselves (dp_shard_cp is the cp group); bf16_reduce:
    # FSDP's gradients in bf16, the K/V gradients still in cp_reduce_dtype fp32.
    "cp": (2, [CP, "2"], ("bf16", "bf16_reduce")),
    "cp_fsdp": (4, [SHARD, "2", CP, "2"], ("bf16",)),
}

EP = "--parallelism.expert_parallel_degree"
# Expert parallel, bf16 gradient reductions: under TP (efsdp 1: the experts' gradients need no
# reduction; EP peers are the ranks of one tp coordinate) and over efsdp 2 (dp_shard 4 x EP 2).
MOE_LAYOUTS = {"moe_ep2_tp2": [SHARD, "2", TP, "2", EP, "2"], "moe_ep2_efsdp2": [SHARD, "4", EP, "2"]}


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _trainer(tmp_path: Path, *extra: str) -> trainer_module.Trainer:
    return trainer_module.Trainer(load_config([*BASE, *extra, "--job.dump_folder", str(tmp_path)]))


@pytest.mark.parametrize("precision", ["bf16", "fp32", "pure_bf16", "fp8", "fp32_names"])
def test_audit_passes_single_process(tmp_path: Path, precision: str) -> None:
    result = _trainer(tmp_path, *PRECISIONS[precision]).audit()
    assert result.ok, result.breaches
    saved = json.loads((tmp_path / "precision_audit.json").read_text())
    assert saved["ok"] and saved["breaches"] == []
    low = {
        "bf16": "bfloat16",
        "fp32": "float32",
        "pure_bf16": "bfloat16",
        "fp8": "float8_e4m3fn",
        "fp32_names": "float32",
    }[precision]
    storage = "bfloat16" if precision == "pure_bf16" else "float32"
    # What was recorded, not only that nothing was flagged: every Linear and norm of the model.
    assert saved["modules"]["layers.0.attention.wq"] == {"forward matmul": [low]}
    assert saved["modules"]["layers.3.ffn_norm"] == {"compute": ["float32"]}
    assert saved["modules"]["<loss>"] == {"log_softmax": ["float32"]}
    assert saved["tensors"] == {"parameters": [storage], "gradients": [storage], "optimizer_state": [storage]}
    if precision == "fp32_names":  # layers.0 by name in fp32, the next block in bf16
        assert saved["modules"]["layers.1.attention.wq"] == {"forward matmul": ["bfloat16"]}
        assert saved["modules"]["output"] == {"forward matmul": ["float32"]}
        report = json.loads((tmp_path / "precision_report.json").read_text())
        assert (
            "layers.0.attention.wq" in report["fp32_by_name"] and "layers.1.attention.wq" not in report["fp32_by_name"]
        )
        linear_rows = {
            g["compute_dtype"] for g in report["param_groups"] if g["module_type"] == "torch.nn.modules.linear.Linear"
        }
        assert linear_rows == {"float32", "bfloat16"}


def test_fp32_module_name_matching_nothing_is_an_error() -> None:
    from torchtitan_amp.core.errors import PrecisionError
    from torchtitan_amp.train.job import resolve

    with pytest.raises(PrecisionError, match="'mixed_precision.fp32_module_names' entry 'layer.0' matches no module"):
        resolve(load_config([*BASE, *BF16, "--mixed_precision.fp32_module_names", "output,layer.0"]), 1, "cpu")


def test_linear_run_in_fp32_is_named(tmp_path: Path) -> None:
    t = _trainer(tmp_path, *BF16)
    wq = t.run.model.layers["1"].attention.wq

    def fp32_forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return F.linear(x.float(), wq.weight.float())

    wq.forward = fp32_forward
    breaches = [str(b) for b in t.audit().breaches]
    assert breaches == ["layers.1.attention.wq: forward matmul: promised bfloat16, saw float32"]


def test_norm_run_in_bf16_is_named(tmp_path: Path) -> None:
    t = _trainer(tmp_path, *BF16)
    norm = t.run.model.layers["0"].ffn_norm
    norm.forward = lambda x: F.rms_norm(x.bfloat16(), (x.shape[-1],), norm.weight.bfloat16(), norm.eps).to(x.dtype)
    breaches = t.audit().breaches
    # torch's rms_norm upcasts part of its bf16 decomposition itself: fp32 ops are seen too.
    assert [(b.what, b.promised, "bfloat16" in b.seen) for b in breaches] == [
        ("layers.0.ffn_norm: computes_in_fp32 module", ["float32"], True)
    ]


def test_low_precision_logits_at_the_loss_are_named(tmp_path: Path, monkeypatch) -> None:
    # Pure bf16: no autocast, whose fp32 rule for log_softmax would rescue the loss by itself.
    t = _trainer(tmp_path, *PRECISIONS["pure_bf16"])
    monkeypatch.setattr(
        trainer_module,
        "loss_fn",
        lambda logits, labels, reduction="mean": F.cross_entropy(
            logits.bfloat16().flatten(0, 1), labels.flatten(), reduction=reduction
        ),
    )
    breaches = [str(b) for b in t.audit().breaches]
    assert breaches == ["loss: log_softmax input: promised float32, saw bfloat16"]


def test_audit_with_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'mixed_precision.audit' records the eager model's ops"):
        load_config([*BASE, "--mixed_precision.audit", "--compile.enable"])


def test_train_py_audit_exit_codes(tmp_path: Path) -> None:
    ok = run_python("train.py", *BASE, *BF16, "--mixed_precision.audit", "--job.dump_folder", str(tmp_path))
    assert ok.returncode == 0 and "precision audit: PASS" in ok.stdout, ok.describe()
    assert json.loads((tmp_path / "precision_audit.json").read_text())["ok"]
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


# ---------------------------------------------------------------------------------------------
# Every layout: two launches


@pytest.fixture(scope="module")
def audits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("audit")
    results: dict[str, dict] = {}
    for nproc in (2, 4):
        jobs = [
            {
                "audit": str(root / f"{layout}_{precision}.json"),
                "args": [
                    *BASE,
                    *PRECISIONS[precision],
                    *args,
                    "--job.dump_folder",
                    str(root / f"{layout}_{precision}"),
                ],
            }
            for layout, (n, args, precisions) in LAYOUTS.items()
            if n == nproc
            for precision in precisions
        ]
        if nproc == 2:
            jobs.append(
                {
                    "audit": str(root / "broken.json"),
                    "break": "fsdp_reduce_in_fp32",
                    "args": [
                        *BASE,
                        *PRECISIONS["bf16_reduce"],
                        *LAYOUTS["fsdp"][1],
                        "--job.dump_folder",
                        str(root / "broken"),
                    ],
                }
            )
            jobs.append(
                {
                    "audit": str(root / "broken_cp.json"),
                    "break": "cp_reduce_in_bf16",
                    "args": [*BASE, *BF16, *LAYOUTS["cp"][1], "--job.dump_folder", str(root / "broken_cp")],
                }
            )
            # The broken MoE run on EP 2 (over FSDP 2's ranks): its router and its dispatch both named.
            jobs += [
                {
                    "audit": str(root / f"{name}.json"),
                    "break": broken,
                    "args": [*BASE, *BF16, *MOE, *LAYOUTS["fsdp"][1], *extra, "--job.dump_folder", str(root / name)],
                }
                for name, broken, extra in (
                    ("moe_fsdp_bf16", None, []),
                    ("broken_router", "router_in_bf16+ep_dispatch_in_fp32", [EP, "2"]),
                )
            ]
        if nproc == 4:
            jobs += [
                {
                    "audit": str(root / f"{name}.json"),
                    "args": [*BASE, *PRECISIONS["bf16_reduce"], *MOE, *layout, "--job.dump_folder", str(root / name)],
                }
                for name, layout in MOE_LAYOUTS.items()
            ]
        launch_worker("ckpt_jobs", root / f"launch{nproc}", jobs, nproc, timeout=400)
    for path in root.glob("*.json"):
        results[path.stem] = json.loads(path.read_text())
    return results


@pytest.mark.parametrize("run", [f"{layout}_{precision}" for layout, (_, _, ps) in LAYOUTS.items() for precision in ps])
def test_audit_passes_on_every_layout(audits: dict, run: str) -> None:
    result = audits[run]
    assert result["ok"], result["breaches"]
    # Merged over ranks: every stage's modules (PP: the last block is on stage 1) and shard's ops
    # were recorded.
    assert result["modules"]["layers.3.feed_forward.w1"]["forward matmul"], result["modules"]
    if run.endswith(("nvfp4", "mxfp8")):  # every converted Linear's three GEMMs seen, merged over the ranks
        assert len(result["block_scaled_gemms"]) == 14 and all(
            sorted(p) == ["dgrad", "forward", "wgrad"] for p in result["block_scaled_gemms"].values()
        ), result
    if run.endswith("fp32_names"):
        assert result["modules"]["layers.0.feed_forward.w1"]["forward matmul"] == ["float32"], result["modules"]
        assert result["modules"]["layers.1.feed_forward.w1"]["forward matmul"] == ["bfloat16"], result["modules"]
    if (
        run.endswith(("_reduce", "fp32_names", "frozen", "lora"))
        and not run.startswith(("tp", "pp"))
        or run == "ddp_fp16"
    ):
        # The reduction was seen, in the reduce dtype: the audit did not pass by seeing nothing.
        reduce = "float16" if run == "ddp_fp16" else "bfloat16"
        assert any(
            reduce in by_dtype
            for c, by_dtype in result["collectives"].items()
            if c.startswith(("reduce_scatter:dp", "all_reduce:dp"))
        ), result["collectives"]


@pytest.mark.parametrize(
    "layout, collective", [("ddp", "all_reduce:dp_replicate"), ("fsdp", "reduce_scatter:dp_shard")]
)
def test_frozen_parameters_send_no_gradients(audits: dict, layout: str, collective: str) -> None:
    """The frozen Linears' gradients would be 2 bytes per parameter in the bf16 reduction: they
    are missing from it, and the frozen parameters are in no optimizer state."""
    from torchtitan_amp.train.job import build_model_parts, resolve

    job = resolve(load_config([*BASE, *PRECISIONS["frozen"]]), 1, "cpu")
    model = build_model_parts(job, torch.device("meta"), [0], materialize=False).parts[0]
    frozen_linear = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        for p in m.parameters()
        if not p.requires_grad
    )
    full, frozen = (audits[f"{layout}_{p}"]["collectives"][collective]["bfloat16"] for p in ("bf16_reduce", "frozen"))
    # debugmodel_tiny (dim 64, FFN hidden 256): layers.0's attention and FFN, layers.1's attention.
    assert frozen_linear == 4 * 64 * 64 + 3 * 64 * 256 + 4 * 64 * 64, frozen_linear
    assert full - frozen >= 2 * frozen_linear, (full, frozen, frozen_linear)


@pytest.mark.parametrize(
    "layout, collective", [("ddp", "all_reduce:dp_replicate"), ("fsdp", "reduce_scatter:dp_shard")]
)
def test_lora_sends_only_adapter_gradients(audits: dict, layout: str, collective: str) -> None:
    """LoRA on DDP 2 (the bf16 compress hook) and FSDP 2 (adapters sharded in groups of their own):
    the gradient reduction carries the adapters' gradients, 2 bytes each in bf16, and nothing of
    the frozen base."""
    from torchtitan_amp.precision import lora
    from torchtitan_amp.train.job import build_model_parts, resolve

    job = resolve(load_config([*BASE, *PRECISIONS["lora"]]), 1, "cpu")
    model = build_model_parts(job, torch.device("meta"), [0], materialize=False).parts[0]
    adapters = sum(p.numel() for p in lora.adapter_parameters(model).values())
    # debugmodel_tiny (dim 64, 4 layers): rank 8 on wq and wv, (64 + 64) * 8 each.
    assert adapters == 4 * 2 * (64 + 64) * 8, adapters
    assert audits[f"{layout}_lora"]["collectives"][collective]["bfloat16"] == 2 * adapters


def test_fsdp_reduce_in_the_wrong_dtype_is_named(audits: dict) -> None:
    breaches = audits["broken"]["breaches"]
    whats = {b["what"] for b in breaches}
    assert "gradient reduce_scatter:dp_shard: float32 bytes" in whats, breaches
    assert "gradient reduction of lower-precision-safe modules" in whats, breaches


@pytest.mark.parametrize("run", ["cp_bf16", "cp_bf16_reduce", "cp_fsdp_bf16"])
def test_context_parallel_collectives(audits: dict, run: str) -> None:
    """K/V gathered over cp in bf16 (causal attention gathers no positions: each chunk's keys are
    a prefix of the window), their gradients summed in fp32; FSDP's collectives on the flattened
    dp_shard x cp dim, its gradients in reduce_dtype."""
    c = audits[run]["collectives"]
    assert set(c["all_gather:cp"]) == {"bfloat16"}, c
    assert set(c["reduce_scatter:cp"]) == {"float32"}, c
    # debugmodel_tiny: 4 layers, K and V [2, 32, 64] gathered (bf16) and reduce-scattered (fp32).
    assert c["all_gather:cp"]["bfloat16"] == 4 * 2 * 2 * 32 * 64 * 2, c
    assert c["reduce_scatter:cp"]["float32"] == 4 * 2 * 2 * 32 * 64 * 4, c
    reduce = "bfloat16" if run.endswith("_reduce") else "float32"
    assert reduce in c["reduce_scatter:dp_shard_cp"] and "bfloat16" in c["all_gather:dp_shard_cp"], c


def test_moe_routers_fp32_experts_bf16(audits: dict) -> None:
    """The MoE family under bf16 FSDP: routers' matmuls in the plan's router_dtype (fp32), the
    grouped experts and the shared expert in bf16, like Linears."""
    result = audits["moe_fsdp_bf16"]
    assert result["ok"], result["breaches"]
    modules = result["modules"]
    assert modules["layers.1.feed_forward.router"]["forward matmul"] == ["float32"], modules
    assert modules["layers.1.feed_forward.experts"]["forward matmul"] == ["bfloat16"], modules
    assert modules["layers.1.feed_forward.shared_expert.w1"]["forward matmul"] == ["bfloat16"], modules


@pytest.mark.parametrize("run", list(MOE_LAYOUTS))
def test_expert_parallel_audits(audits: dict, run: str) -> None:
    """EP x TP and EP over efsdp 2 under bf16 with bf16 gradient reductions: routers compute and
    reduce in fp32, experts compute in bf16; every gradient reduction is checked by the audit's
    data-parallel rules (the experts' over efsdp too: named, not "other")."""
    result = audits[run]
    assert result["ok"], result["breaches"]
    modules, collectives = result["modules"], result["collectives"]
    assert modules["layers.1.feed_forward.router"]["forward matmul"] == ["float32"], modules
    assert modules["layers.1.feed_forward.experts"]["forward matmul"] == ["bfloat16"], modules
    assert not any(c.endswith(":other") for c in collectives), collectives
    # The token exchange, forward and backward, seen in bf16 (the counts before it as int64).
    assert set(collectives["all_to_all:ep"]) == {"bfloat16", "int64"}, collectives
    # Both dtypes reduced over dp_shard: bf16 (safe modules) and fp32 (routers, norms).
    assert set(collectives["reduce_scatter:dp_shard"]) == {"bfloat16", "float32"}, collectives
    if run == "moe_ep2_efsdp2":
        # debugmodel_moe: 3 MoE layers of 3 [8, 64, 64] expert weights, 4 per EP rank, bf16.
        assert collectives["reduce_scatter:efsdp"] == {"bfloat16": 3 * 3 * 4 * 64 * 64 * 2}, collectives
    else:
        assert "all_gather:tp" in collectives and not any("efsdp" in c for c in collectives), collectives


def test_router_in_bf16_and_tokens_sent_in_fp32_are_named(audits: dict) -> None:
    """EP 2 on FSDP 2's ranks with two breaches: routers computing in bf16 under an fp32
    router_dtype, and the token rows crossing ep in fp32 under a bf16 dispatch dtype."""
    breaches = audits["broken_router"]["breaches"]
    assert breaches == [
        {"what": f"layers.{i}.feed_forward.router: forward matmul", "promised": ["float32"], "seen": ["bfloat16"]}
        for i in (1, 2, 3)
    ] + [{"what": "expert-parallel token all_to_all:ep", "promised": ["bfloat16"], "seen": ["float32"]}], breaches


def test_cp_reduce_in_the_wrong_dtype_is_named(audits: dict) -> None:
    breaches = audits["broken_cp"]["breaches"]
    assert breaches == [{"what": "K/V gradient reduce_scatter:cp", "promised": ["float32"], "seen": ["bfloat16"]}]


def test_cp_breaches_unit() -> None:
    """check_context_parallel on recorded categories: a sum in another dtype, K/V gathered in fp32
    under a bf16 promise, and nothing seen at all are each named."""
    from torchtitan_amp.precision.audit import check_context_parallel

    good = {"all_gather:cp": {"bfloat16": 8, "int64": 4}, "reduce_scatter:cp": {"float32": 16}}
    assert check_context_parallel(good, "float32", {"bfloat16"}) == []
    bad = {"all_gather:cp": {"float32": 8, "int64": 4}, "reduce_scatter:cp": {"bfloat16": 8, "float32": 8}}
    assert [str(b) for b in check_context_parallel(bad, "float32", {"bfloat16"})] == [
        "K/V all_gather:cp: promised bfloat16, saw float32",
        "K/V gradient reduce_scatter:cp: promised float32, saw bfloat16/float32",
    ]
    assert [str(b) for b in check_context_parallel({}, "bfloat16", {"bfloat16"})] == [
        "K/V all_gather:cp: promised bfloat16, saw none seen",
        "K/V gradient reduce_scatter:cp: promised bfloat16, saw none seen",
    ]


def test_ep_breaches_unit() -> None:
    """check_expert_parallel on recorded categories: rows in another dtype, nothing seen on a rank
    holding expert-parallel layers, and an all-to-all on another group are each named; a rank
    without such layers (a PP stage of dense blocks) may see none."""
    from torchtitan_amp.precision.audit import check_expert_parallel

    good = {"all_to_all:ep": {"bfloat16": 64, "int64": 32}}
    assert check_expert_parallel(good, "bfloat16", True) == []
    assert check_expert_parallel({}, "bfloat16", False) == []
    assert [str(b) for b in check_expert_parallel({"all_to_all:ep": {"int64": 32}}, "bfloat16", True)] == [
        "expert-parallel token all_to_all:ep: promised bfloat16, saw none seen"
    ]
    bad = {"all_to_all:ep": {"bfloat16": 8, "float32": 8}, "all_to_all:dp_shard": {"bfloat16": 8}}
    assert [str(b) for b in check_expert_parallel(bad, "bfloat16", True)] == [
        "expert-parallel token all_to_all:ep: promised bfloat16, saw bfloat16/float32",
        "expert-parallel all_to_all:dp_shard: promised all_to_all:ep, saw bfloat16",
    ]
