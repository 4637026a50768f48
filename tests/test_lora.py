"""LoRA / QLoRA ([lora], precision/lora.py and lora_plan.py): the plan decides each part's dtypes
(the frozen base in the Linears' compute dtype or NF4, fp32 adapters), the report lists them, the
audit checks the adapters' gradients are fp32 and the base has none; bad targets are one line; a
LoRA model equals PEFT's on the same transformers model and init (loss and every adapter
gradient, fp32); merged and PEFT-format exports give our logits; a QLoRA step leaves its NF4 base
bit-identical. In-process only (no ranks launched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan, lora
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

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
    "--optimizer.lr",
    "1e-2",
    "--lora.enable",
]
BF16 = ["--mixed_precision.enabled", "true"]
FP32 = ["--mixed_precision.enabled", "false"]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _plan(*overrides: str, world: int = 1) -> PrecisionPlan:
    config = load_config([*BASE, *overrides])
    return PrecisionPlan.from_config(config, ParallelDims.from_config(config.parallelism, world), "cpu", probe=None)


def test_plan_decides_each_part() -> None:
    off = PrecisionPlan.from_config(load_config([]), ParallelDims.from_config(load_config([]).parallelism, 1), "cpu")
    assert off.lora is None
    bf16 = _plan(*BF16).lora
    assert bf16 is not None and (bf16.base_dtype, bf16.compute_dtype, bf16.adapter_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    fp32 = _plan(*FP32, "--lora.rank", "4", "--lora.alpha", "2").lora
    assert fp32 is not None and (fp32.base_dtype, fp32.adapter_dtype, fp32.scaling) == (
        torch.float32,
        torch.float32,
        0.5,
    )
    assert fp32.parts()["base"]["grad_dtype"] is None and fp32.parts()["adapters"]["grad_dtype"] == "float32"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--training.dtype", "bfloat16", *FP32], "trains fp32 master adapters"),
        (["--parallelism.tensor_parallel_degree", "2"], "data-parallel layouts"),
        (["--lora.quantize_base", "nf4", "--parallelism.data_parallel_shard_degree", "2"], "one process"),
    ],
)
def test_what_cannot_run_is_one_line(overrides: list[str], message: str) -> None:
    world = 2 if any(o.endswith("degree") for o in overrides) else 1
    with pytest.raises(PrecisionError, match=message) as e:
        _plan(*overrides, world=world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("layers.*.attention.wz", "'layers.*.attention.wz' matches no module"),
        ("layers.*.attention_norm", "matches 'layers.0.attention_norm', a RMSNorm: LoRA adapts nn.Linear modules only"),
    ],
)
def test_bad_target_is_one_line(target: str, message: str) -> None:
    with pytest.raises(PrecisionError, match=message.replace("*", r"\*").replace(".", r"\.")) as e:
        job_mod.resolve(load_config([*BASE, *FP32, "--lora.target_modules", target]), 1, "cpu")
    assert "\n" not in str(e.value)


def test_bf16_lora_trains_adapters_only_and_passes_the_audit(tmp_path: Path) -> None:
    args = [*BASE, *BF16, "--training.steps", "3", "--job.dump_folder", str(tmp_path)]
    t = trainer_module.Trainer(load_config(args))
    named = dict(t.run.model.named_parameters())
    adapters = lora.adapter_parameters(t.run.model)
    assert set(adapters) == {
        f"layers.{i}.attention.w{w}.lora_{ab}.weight"
        for i in range(len(t.run.model.layers))
        for w in "qv"
        for ab in "AB"
    }
    assert all(p.requires_grad and p.dtype == torch.float32 for p in adapters.values())
    base = {n: p for n, p in named.items() if n not in adapters}
    assert not any(p.requires_grad for p in base.values())
    assert base["layers.0.attention.wq.weight"].dtype == base["layers.0.attention.wk.weight"].dtype == torch.bfloat16
    assert base["layers.0.attention_norm.weight"].dtype == torch.float32  # an fp32 island stays fp32
    before = {n: p.detach().clone() for n, p in base.items()}
    t.train()
    assert all(torch.equal(base[n], before[n]) and base[n].grad is None for n in base)
    assert {id(p) for p in t.run.optimizer.state} == {id(p) for p in adapters.values()}
    assert all(v.dtype == torch.float32 for s in t.run.optimizer.state.values() for v in s.values() if v.dim())
    assert any(adapters[n].abs().max() > 0 for n in adapters if ".lora_B." in n)  # B left zero: it learned
    report = json.loads((tmp_path / "precision_report.json").read_text())["lora"]
    assert report["base"] == {"storage_dtype": "bfloat16", "compute_dtype": "bfloat16", "grad_dtype": None}
    assert report["adapters"] == {"storage_dtype": "float32", "compute_dtype": "bfloat16", "grad_dtype": "float32"}
    assert len(report["adapted_modules"]) == 2 * len(t.run.model.layers)
    audited = trainer_module.Trainer(load_config([*args[:-1], str(tmp_path / "audit")])).audit()
    assert audited.ok, [str(b) for b in audited.breaches]


def test_audit_names_a_base_gradient_and_a_low_precision_adapter_gradient(tmp_path: Path) -> None:
    t = trainer_module.Trainer(load_config([*BASE, *BF16, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]))
    model = t.run.model
    wq = model.get_submodule("layers.0.attention.wq")
    wq.weight.grad = torch.zeros_like(wq.weight)
    wq.lora_A.weight.grad_dtype = None  # let a bf16 gradient in, as a broken path would leave it
    wq.lora_A.weight.grad = torch.zeros_like(wq.lora_A.weight, dtype=torch.bfloat16)
    seen = lora.audit(t.run.plan, [model])
    assert seen == {
        "adapter gradients": ["bfloat16"],
        "base parameters with a gradient": ["layers.0.attention.wq.weight"],
    }
