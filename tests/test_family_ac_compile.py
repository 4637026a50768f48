"""Activation checkpointing and torch.compile for the Qwen3, DeepSeek-V3 and gpt-oss families:
each family's debug model trains the same losses, bit for bit, under every
`activation_checkpoint.mode` (a recompute repeats the forward's fp32 ops exactly, routing
included), and a DeepSeek-V3 block (MLA, group-limited routing) and a gpt-oss block (sinks,
sliding window, clamped SwiGLU) compile (aot_eager) to eager's output and gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.launch import by_step
from torchtitan_amp.config import load_config
from torchtitan_amp.models import get_family

STEPS = 3


def _losses(tmp_path: Path, family: str, *extra: str) -> dict[int, tuple[float, float | None]]:
    """{step: (loss, mtp_loss or None)} of STEPS steps of `family` ("name" or "name:flavor",
    flavor debugmodel by default)."""
    from torchtitan_amp.train.trainer import Trainer

    family, _, flavor = family.partition(":")
    argv = ["--model.name", family, "--model.flavor", flavor or "debugmodel", "--model.tokenizer", "byte"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(STEPS)]
    argv += ["--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3"]
    argv += ["--mixed_precision.enabled", "false", "--job.dump_folder", str(tmp_path), *extra]
    Trainer(load_config(argv)).train()
    return {step: (row["loss"], row.get("mtp_loss")) for step, row in by_step(tmp_path).items() if "loss" in row}


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "deepseek_v3:debugmodel_mtp", "gpt_oss"])
def test_ac_modes_train_the_same_losses(tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """none, selective (every 2nd block), selective op-level and full: one process's fp32
    losses (and multi-token prediction losses, whose depth's block is recomputed too) over STEPS
    steps, equal bit for bit (the expert-bias balancing and the aux loss count each token once
    under a recompute)."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
    modes = {
        "none": (),
        "selective": ("--activation_checkpoint.mode", "selective"),
        "op": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
        "full": ("--activation_checkpoint.mode", "full"),
    }
    losses = {name: _losses(tmp_path / name, family, *extra) for name, extra in modes.items()}
    print(losses)
    assert len(losses["none"]) == STEPS
    assert all(got == losses["none"] for got in losses.values()), losses


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_block_compiles_to_eagers_output_and_gradients(family: str) -> None:
    """A block of each family (an MoE block: DeepSeek-V3's second, gpt-oss's first, sliding)
    under torch.compile with the family's fullgraph setting computes eager's output and
    gradients, fp32. aot_eager: dynamo, fake tensors and AOT autograd as inductor sees them,
    without the C++ compile. Tolerance: the same fp32 ops in another order at most (rtol 1e-5)."""
    spec = get_family(family)
    torch.manual_seed(0)
    model: Any = spec.build_model(spec.flavors["debugmodel"])
    model.init_weights()
    block: Any = model.layers["1" if family == "deepseek_v3" else "0"]
    x = torch.randn(2, 24, model.model_args.dim, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=spec.compile_fullgraph)
    results = []
    for fn in (compiled, block):
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = fn(x, model.rope_cos, model.rope_sin)
        y.square().sum().backward()
        assert x.grad is not None
        results.append(
            [y.detach(), x.grad.clone(), *(p.grad.clone() for p in block.parameters() if p.grad is not None)]
        )
    assert len(results[0]) == len(results[1])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ac_and_compile_wrap_the_mtp_depths_block() -> None:
    """A multi-token prediction depth's block is wrapped as the layers are: recomputed whole
    under full AC and selective every-2nd (the depth counted after the 4 layers: index 4), by
    region under op-level SAC (an MoE block: its feed-forward recomputed whole), and compiled;
    its norms, eh_proj and the shared head around it are not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from torchtitan_amp.config import ActivationCheckpointConfig
    from torchtitan_amp.distributed.activation_checkpoint import apply_ac
    from torchtitan_amp.distributed.compile import apply_compile

    spec = get_family("deepseek_v3")
    options = {"full": ("full", "2"), "selective": ("selective", "2"), "op": ("selective", "op")}
    for name, (mode, option) in options.items():
        model: Any = spec.build_model(spec.flavors["debugmodel_mtp"])
        apply_ac(model, ActivationCheckpointConfig(mode=mode, selective_ac_option=option), spec.ac_regions)
        depth = model.mtp["4"]
        wrapped = depth.block.feed_forward if name == "op" else depth.block
        assert isinstance(wrapped, CheckpointWrapper), (name, type(wrapped))
        assert not isinstance(depth.eh_proj, CheckpointWrapper)
    model = spec.build_model(spec.flavors["debugmodel_mtp"])
    apply_compile(model, fullgraph=spec.compile_fullgraph)
    assert model.mtp["4"].block._compiled_call_impl is not None
    assert model.mtp["4"]._compiled_call_impl is None and model.layers["0"]._compiled_call_impl is not None
