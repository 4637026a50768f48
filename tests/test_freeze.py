"""Frozen parameters in low precision: `training.freeze` module-name patterns get no
gradient, no optimizer state and no gradient reduction, and are stored in their compute dtype
(bf16 for the lower-precision-safe Linears in mixed precision, fp32 for the fp32 islands), while
trained parameters stay fp32. The precision audit of frozen runs on DDP 2, FSDP 2, TP 2 and PP 2
(and their gradient bytes) is in test_audit.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launch import by_step, launch_worker
from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.distributed import grad_norm
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = [pytest.mark.dist, pytest.mark.oldest_torch]

BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--mixed_precision.enabled",
    "true",
]
FREEZE = ["--training.freeze", "tok_embeddings,layers.0,layers.1.attention"]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def test_frozen_parameters_take_no_gradient_no_state_and_their_compute_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # lr 1e-2, not BASE's 3e-3: debugmodel_tiny's trained blocks learn too little in 3 steps at
    # 3e-3 for the margins below (measured 0.033 and 0.078 under the twin at steps 2 and 3).
    t = trainer_module.Trainer(
        load_config(
            [*BASE, *FREEZE, "--training.steps", "3", "--optimizer.lr", "1e-2", "--job.dump_folder", str(tmp_path)]
        )
    )
    named = dict(t.run.model.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    assert frozen == {n for n in named if n.startswith(("tok_embeddings.", "layers.0.", "layers.1.attention."))}
    # Safe modules (Linear) store their compute dtype; fp32 islands (embedding, norms) stay fp32.
    assert named["layers.0.attention.wq.weight"].dtype == torch.bfloat16
    assert named["layers.1.attention.wo.weight"].dtype == torch.bfloat16
    assert named["layers.0.ffn_norm.weight"].dtype == named["tok_embeddings.weight"].dtype == torch.float32
    assert named["layers.1.feed_forward.w1.weight"].dtype == torch.float32 and "layers.1.ffn_norm.weight" not in frozen
    before = {n: named[n].detach().clone() for n in frozen}
    clip_devices = []  # the trainer names its device: a rank with nothing trained has no parameter to ask
    clip = trainer_module.clip_grad_norm_
    monkeypatch.setattr(
        trainer_module, "clip_grad_norm_", lambda *a, **k: clip_devices.append(k.get("device")) or clip(*a, **k)
    )
    t.train()
    assert clip_devices == [t.run.device] * 3, clip_devices
    assert all(torch.equal(named[n], before[n]) for n in frozen)
    assert all(named[n].grad is None for n in frozen)
    state_ids = {id(p) for p in t.run.optimizer.state}
    assert not any(id(named[n]) in state_ids for n in frozen) and len(state_ids) == len(named) - len(frozen)
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert report["frozen"]["layers.0.attention.wq.weight"] == "bfloat16" and len(report["frozen"]) == len(frozen)
    rows = {(g["module_type"].rsplit(".", 1)[-1], g["trained"]): g for g in report["param_groups"]}
    assert rows["Linear", False]["storage_dtype"] == "bfloat16" and rows["Linear", True]["storage_dtype"] == "float32"
    # The trained parameters learn around the frozen ones: against a twin run on the same batches
    # from the same weights without learning (lr 1e-12), the loss is lower at steps 2 and 3 by
    # more than bf16 noise (~1e-3). Measured: torch 2.13 6.084, 5.675, 5.834 against 6.084,
    # 5.786, 6.147 (the batches alone move the loss by -0.30, then +0.36, so "it fell" proves
    # nothing); torch 2.11 (other initial weights) 6.030, 6.001, 5.667 against 6.030, 6.109, 5.962.
    losses = [r["loss"] for r in by_step(tmp_path).values()]
    still = tmp_path / "no_learning"
    trainer_module.Trainer(
        load_config(
            [*BASE, *FREEZE, "--training.steps", "3", "--optimizer.lr", "1e-12", "--job.dump_folder", str(still)]
        )
    ).train()
    baseline = [r["loss"] for r in by_step(still).values()]
    assert len(losses) == len(baseline) == 3 and losses[0] == baseline[0], (losses, baseline)
    assert losses[1] < baseline[1] - 0.03 and losses[2] < baseline[2] - 0.1, (losses, baseline)


def test_grad_norm_of_a_stage_with_nothing_trained_is_on_the_given_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline stage whose parameters are all frozen still joins the stages' norm all-reduce:
    with the device it is given (the trainer's), not a CPU tensor, which nccl refuses. Recorded
    on the meta device, which no default can produce."""
    sent = []
    monkeypatch.setattr(grad_norm.dist, "all_reduce", lambda t, group=None: sent.append(t))
    meta = torch.device("meta")
    norm = grad_norm.clip_grad_norm_([], 1.0, object(), device=meta)  # type: ignore[arg-type]
    assert [t.device for t in sent] == [meta] and norm.device == meta and norm.dtype == torch.float32


def test_fp32_training_freezes_in_fp32(tmp_path: Path) -> None:
    """Without mixed precision nothing computes in bf16: frozen parameters keep the storage dtype."""
    job = job_mod.resolve(load_config([*BASE, "--mixed_precision.enabled", "false", *FREEZE]), 1, "cpu")
    model = job_mod.build_model_parts(job, torch.device("cpu"), [0]).parts[0]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.float32 for p in frozen)


def test_freeze_pattern_matching_nothing_is_an_error() -> None:
    with pytest.raises(PrecisionError, match="'training.freeze' entry 'layer.0' matches no module"):
        job_mod.resolve(load_config([*BASE, "--training.freeze", "layer.0"]), 1, "cpu")


def test_fsdp_frozen_resume_is_bitwise(tmp_path: Path) -> None:
    """bf16 frozen parameters and fp32 trained ones in one checkpoint; the resume restores both."""
    a, b = tmp_path / "a", tmp_path / "b"
    args = [
        *BASE,
        *FREEZE,
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    launch_worker(
        "ckpt_jobs",
        tmp_path / "launch",
        [
            {"args": [*args, "--job.dump_folder", str(a)]},
            {
                "args": [*args, "--job.dump_folder", str(b)],
                "copy": [[str(a / "checkpoint" / "step-2"), str(b / "checkpoint" / "step-2")]],
            },
        ],
        2,
        timeout=300,
    )
    ra, rb = by_step(a), by_step(b)
    assert sorted(rb) == [3, 4]
    for step in (3, 4):
        assert (rb[step]["loss"], rb[step]["grad_norm"]) == (ra[step]["loss"], ra[step]["grad_norm"]), step


# The first block's parameters: its norms are the ones TP's sequence parallel re-registers.
LAYER_0 = {
    f"layers.0.{n}.weight"
    for n in (
        "attention_norm",
        "ffn_norm",
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
}


def test_tp_keeps_frozen_norms_frozen(tmp_path: Path) -> None:
    """Sequence parallel re-registers the norm weights as DTensors, which require grad again:
    frozen norms must stay frozen (no gradient, no state, unchanged) under TP, with and without SP."""
    args = [
        *BASE,
        "--training.freeze",
        "layers.0",
        "--training.steps",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]
    launch_worker(
        "layouts",
        tmp_path,
        [
            {"name": "sp", "args": args},
            {"name": "no_sp", "args": [*args, "--parallelism.enable_sequence_parallel", "false"]},
        ],
        2,
        timeout=300,
    )
    for name in ("sp", "no_sp"):
        frozen = json.loads((tmp_path / name / "rank0.json").read_text())["frozen_params"]
        for rank in (0, 1):
            # Each frozen parameter (by training.freeze's tag, whatever requires_grad says) on each
            # rank: no gradient, not in the optimizer, no state, its local shard bit-identical to
            # the one it had before train().
            info = json.loads((tmp_path / name / f"rank{rank}.json").read_text())["frozen"]
            assert set(info) == LAYER_0, (name, sorted(info))
            for param, facts in info.items():
                assert facts == {
                    "requires_grad": False,
                    "grad_is_none": True,
                    "in_optimizer": False,
                    "has_optimizer_state": False,
                    "digest_unchanged": True,
                }, (name, rank, param, facts)
        assert {"layers.0.attention_norm.weight", "layers.0.ffn_norm.weight", "layers.0.attention.wq.weight"} <= set(
            frozen
        ), name
        assert not any(n.startswith("layers.1") for n in frozen), name
