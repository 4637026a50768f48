"""Op-level selective AC (activation_checkpoint.selective_ac_option = "op"), one process: both
matmul rules (per_op_sac_save_mm "alternate", torchtitan's, and "all") train bit for bit as
without AC in fp32, and a dense block is checkpointed whole while an MoE block is checkpointed by
region. What each rule keeps alive is tests/test_memory_moe.py's
test_op_level_sac_formula_matches_what_stays_alive."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy

from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.distributed import activation_checkpoint
from torchtitan_amp.models import get_family

STEPS = 3
FAMILIES = {"llama3": ("debugmodel", {}), "moe": ("debugmodel_moe", {"n_dense_layers": 1})}


def _ac_args(save_mm: str | None) -> list[str]:
    if save_mm is None:
        return []
    return [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--activation_checkpoint.per_op_sac_save_mm",
        save_mm,
    ]


def _build(name: str, save_mm: str | None) -> torch.nn.Module:
    flavor, overrides = FAMILIES[name]
    family = get_family(name)
    config = load_config(
        ["--model.name", name, "--model.flavor", flavor, "--mixed_precision.enabled", "false", *_ac_args(save_mm)]
    )
    args = dataclasses.replace(family.flavors[flavor], n_layers=3, **overrides)
    torch.manual_seed(0)
    model = family.build_model(args)
    model.init_weights()
    if save_mm is not None:
        activation_checkpoint.apply_ac(model, config.activation_checkpoint, family.ac_regions)
    return model


def _train(name: str, save_mm: str | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses of STEPS SGD steps and the last step's gradients."""
    model = _build(name, save_mm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (2, 33), generator=gen)
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        opt.step()
    return losses, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("save_mm", ["alternate", "all"])
def test_op_sac_is_bitwise_equal_to_no_ac_in_fp32(name: str, save_mm: str) -> None:
    """The recompute runs the same kernels on the same inputs: equal bits, not a tolerance."""
    losses, grads = _train(name, None)
    sac_losses, sac_grads = _train(name, save_mm)
    assert all(torch.equal(a, b) for a, b in zip(losses, sac_losses)), (losses, sac_losses)
    assert len(grads) == len(sac_grads) and all(torch.equal(a, b) for a, b in zip(grads, sac_grads))


def test_dense_blocks_are_checkpointed_whole_moe_blocks_by_region() -> None:
    """torchtitan wraps the whole block: its norms and residual adds are recomputed, not kept. An
    MoE block keeps today's regions (its router and experts are FSDP units of their own)."""
    model = _build("moe", "alternate")
    dense, moe = model.layers["0"], model.layers["1"]
    assert isinstance(dense, CheckpointWrapper)
    assert not isinstance(moe, CheckpointWrapper)
    assert isinstance(moe.attention, CheckpointWrapper) and isinstance(moe.feed_forward, CheckpointWrapper)


def test_alternate_rule_recomputes_every_second_mm() -> None:
    """torchtitan's counter: the 1st, 3rd... mm of a region are saved, the 2nd, 4th... not."""
    policy = activation_checkpoint._op_sac_policy("alternate")
    mm, ctx = torch.ops.aten.mm.default, type("Ctx", (), {"is_recompute": False})()
    got = [policy(ctx, mm) for _ in range(4)]
    keep, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [keep, again, keep, again]
    assert [activation_checkpoint._op_sac_policy("all")(ctx, mm) for _ in range(2)] == [keep, keep]


def test_unknown_matmul_rule_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match="per_op_sac_save_mm") as err:
        load_config(_ac_args("half"))
    assert "alternate" in str(err.value) and "\n" not in str(err.value)
