"""What a model family hands the rest of the framework: one `ModelFamily` object.

torchtitan's TrainSpec is the anchor: the framework never imports a family's modules, it asks
the family named by `model.name` (models.get_family). A family's model follows one decoder shape
that the generic code relies on (pipeline splitting, TP of the ends, FSDP units, AC, compile):

- built as `model_cls(args)`, where `args` is a dataclass with `vocab_size`, `max_seq_len`,
  `n_layers`, `n_heads` and `kv_heads`, kept as `model.model_args`;
- top-level `tok_embeddings`, `layers` (an nn.ModuleDict keyed by global layer index: the
  pipeline split unit and the FSDP / AC / compile unit), `norm` and `output`, any of which a
  pipeline stage may set to None (or delete from `layers`);
- `init_weights(buffer_device=None)` filling every parameter and buffer after `to_empty`;
- optionally `mtp`, an nn.ModuleDict of modules the root's forward runs after `layers` (DeepSeek-V3's
  multi-token prediction depths): FSDP units like blocks, each computing all it does in its forward,
  each with a `block` of the layers' kind that AC and compile wrap as they wrap the layers, and
  split under TP by the family's `tp_block_plan` (given the depth: its whole plan, norms included).

A module that counts something per step (MoE token loads) defines `reset_step_counters()`: the
pipeline calls it after torch's metadata pass ran a forward/backward through the stage.

Numerically sensitive modules declare `computes_in_fp32 = True` (the precision plan and the audit
read that attribute, whatever the family), which makes them fp32 islands by default.
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

ArgsT = TypeVar("ArgsT")  # a family's model-args dataclass


@dataclass(frozen=True)
class Derived:
    """One of our tensors computed from whole HF tensors (gpt-oss: w1 is the even columns of
    `gate_up_proj`): `compute` maps {HF name: tensor} of `sources` to ours (torch ops only, so
    it also runs on meta tensors for the shape). Import only; `HFAdapter.merged` is the way back."""

    sources: tuple[str, ...]
    compute: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    # Whether dim 0 of ours is dim 0 of every source, row for row (stacked experts): a read then
    # takes only its rows of the sources, one at a time, never the whole tensor.
    by_row: bool = False


class HFAdapter(ABC, Generic[ArgsT]):
    """How a family's checkpoints look in Hugging Face form; checkpoint/hf.py does the reading,
    writing, slicing and permuting for every family through these methods (torchtitan's
    BaseStateDictAdapter). A family subclasses it (or another family's adapter) and sets the class
    attributes; `describe` and `stacked` have defaults for a family without such cases."""

    display_name: ClassVar[str]  # the model's name in messages ("Llama")
    # HF tensor names to skip on import (e.g. rotary buffers older exports carry)
    ignored: ClassVar[re.Pattern[str]] = re.compile(r"(?!)")
    field_names: ClassVar[dict[str, str]]  # a config_fields field -> its config.json name (error messages)
    # Our FQNs that the HF form has no place for and whose zero value computes as the HF model does
    # (MoE expert bias): zeroed on import; an export refuses a nonzero one. None: no such tensor.
    zero_in_hf: ClassVar[re.Pattern[str] | None] = None

    @abstractmethod
    def to_hf_name(self, fqn: str) -> str:
        """Our FQN -> its HF tensor name."""

    @abstractmethod
    def from_hf_name(self, name: str) -> str | None:
        """An HF tensor name -> our FQN (None: this model has no place for it)."""

    @abstractmethod
    def rotary_heads(self, fqn: str, args: ArgsT) -> int | None:
        """The head count of a tensor of ours whose rows the HF rotary layout (halves) orders
        differently from ours (interleaved pairs), or None for every other tensor."""

    @abstractmethod
    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The fields of a folder's config.json this family reads, in model-args terms;
        CheckpointError for a config it cannot represent."""

    @abstractmethod
    def args_fields(self, args: ArgsT) -> dict[str, Any]:
        """The same fields as config_fields, from our model args (check_config compares the two)."""

    def hf_config(self, args: ArgsT, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
        """config.json for `args`: the architecture's fields with the tokenizer's bos / eos ids;
        CheckpointError for args the HF form cannot say.

        Args:
            args: the model's arguments (its flavor with the run's vocab size and sequence length).
            dtype: the dtype the weights are saved in, written as torch_dtype ("bfloat16",
                "float32").
            bos_id: the tokenizer's beginning-of-sequence id; None leaves it out.
            eos_id: the tokenizer's end-of-sequence id; None leaves it out.
        """
        cfg = self.architecture_config(args, dtype)
        for key, token in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
            if token is not None:
                cfg[key] = token
        return cfg

    @abstractmethod
    def architecture_config(self, args: ArgsT, dtype: str) -> dict[str, Any]:
        """config.json's architecture fields for `args` (the published spelling), with `dtype` as
        torch_dtype; CheckpointError for args the HF form cannot say."""

    def describe(self, key: str, value: Any) -> Any:
        """A config_fields value as an error message shows it (config.json's spelling)."""
        return value

    def stacked(self, fqn: str, args: ArgsT) -> tuple[list[str], bool] | None:
        """For one of our tensors that HF stores as several stacked along a new dim 0 (MoE experts:
        our [E, dim, hidden] is E HF [hidden, dim] weights), the HF names of its parts and whether
        each is transposed; None for the one-to-one tensors. from_hf_name maps each part to our FQN."""
        return None

    def copies(self, fqn: str, args: ArgsT) -> list[str]:
        """More HF names one of our tensors is written under, beside its own, on export (DeepSeek-V3's
        multi-token prediction layers repeat the embedding and output head); an import skips them
        (`ignored`). []: none."""
        return []

    def derived(self, args: ArgsT) -> dict[str, Derived]:
        """Our FQN -> how it is computed from whole HF tensors, for the tensors that are neither one
        to one nor stacked; their sources are read for them alone. {}: none."""
        return {}

    def merged(
        self, fqn: str, args: ArgsT
    ) -> tuple[str, list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None:
        """For a derived tensor on export: (the HF name, our FQNs it is made of in order, how they
        combine into it); written when the first of them comes, nothing for the others. None: not
        merged."""
        return None


def no_step_metrics(model_parts: list[nn.Module], *groups: Any, **kwargs: Any) -> dict[str, Any]:
    """ModelFamily.after_backward of a family with no per-step state: nothing learnt, no metrics."""
    return {}


def no_update(model_parts: list[nn.Module]) -> None:
    """ModelFamily.after_step of a family with nothing to update after the optimizer."""


def no_loss_factor(model_parts: list[nn.Module], factor: float) -> None:
    """ModelFamily.set_loss_factor of a family whose model adds no loss of its own."""


def no_labels(args: Any) -> bool:
    """ModelFamily.takes_labels of a family whose forward adds no loss of its own from the labels."""
    return False


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the value of model.name that picks it
    model_cls: Callable[[Any], nn.Module]
    args_cls: type  # the dataclass of its shapes (a checkpoint's meta records its fields)
    # Flavor name -> args. The family's own dict, so a flavor registered at run time (into that
    # dict) is accepted by model.flavor from then on.
    flavors: dict[str, Any]
    # (args, parameters without embeddings, seq_len) -> training FLOPs per token (MFU's numerator).
    flops_per_token: Callable[[Any, int, int], int]
    # (sequence-dim placement of the residual stream, the block) -> the block's TP plan
    # (parallelize_module's {submodule name: ParallelStyle}), the ends excepted: they follow the
    # decoder shape. The block lets a family whose blocks differ (dense and MoE) plan each.
    tp_block_plan: Callable[[Any, Any], dict[str, Any]]
    # A block's norms: sequence-parallel under TP with SP on, replicated DTensor params without.
    block_norms: tuple[str, ...]
    # The submodules of a block that op-level selective AC wraps where it cannot wrap the whole
    # block (an MoE block: parallelize.recomputed_whole); never the norms, which stay outside.
    ac_regions: tuple[str, ...]
    # The norm class (the memory model's "norm" kind in lower_precision_safe_modules).
    norm_cls: type[nn.Module]
    # args -> the memory model's dims object (memory.ModelDims or a subclass): shapes, parameter
    # specs with TP sharding, activation bytes per token (the dry run, planner and estimates).
    memory_dims: Callable[[Any], Any]
    # The Hugging Face adapter (checkpoint/hf.py asks it for names, permutations, config fields);
    # None: the family has no Hugging Face form (import and export say so in one line).
    hf: HFAdapter[Any] | None = None
    # The family's per-step hooks, run by the trainer on every step (no-ops by default), with
    # OLMo-core's post_batch / post_optim_step in mind:
    # after_backward: on every rank after each step's backward, before the optimizer step, with
    # (model parts, the group of ranks holding other tokens, the pipeline group, cross_group=the
    # replica groups' in-place sum or None): state that learns from the step outside the optimizer
    # (MoE load balancing); returns metrics for the step's log line as scalar tensors (read by the
    # host only on steps that log).
    after_backward: Callable[..., dict[str, Any]] = no_step_metrics
    # after_step: with the model parts after each optimizer step that is applied (not after one
    # skipped for non-finite gradients): the family's own updates that must follow the weights'
    # (the expert biases that after_backward computed).
    after_step: Callable[[list[nn.Module]], None] = no_update
    # set_loss_factor: (model parts, the factor the trainer multiplies the loss by before
    # backward), for losses the model adds itself (MoE's auxiliary balance loss), which must be
    # scaled alike.
    set_loss_factor: Callable[[list[nn.Module], float], None] = no_loss_factor
    # takes_labels: args -> whether the trainer passes the labels to the forward (`labels=`) and
    # then takes the losses it added (`model.pop_extra_losses()`: {metric name: summed loss},
    # weighted like the main loss, trained on and logged apart): DeepSeek-V3's multi-token prediction.
    takes_labels: Callable[[Any], bool] = no_labels
    # Whether torch.compile may require one graph per block (fullgraph). False for a family whose
    # blocks read sizes on the host (MoE's per-expert token counts): they compile with breaks.
    compile_fullgraph: bool = True

    def build_args(self, flavor: str, vocab_size: int, max_seq_len: int) -> Any:
        """A copy of the flavor with the tokenizer's vocab and the training seq len.

        Args:
            flavor: the registered flavor's name (model.flavor).
            vocab_size: the tokenizer's vocabulary size.
            max_seq_len: the training sequence length (training.seq_len), the rotary tables' length.
        """
        if flavor not in self.flavors:
            allowed = ", ".join(self.flavors)
            raise ValueError(f"unknown model flavor {flavor!r}; allowed flavors: {allowed}")
        return dataclasses.replace(self.flavors[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len)

    def build_model(self, args: Any) -> nn.Module:
        return self.model_cls(args)

    def args_from_dict(self, fields: dict[str, Any]) -> Any:
        """The args a checkpoint's meta recorded (dataclasses.asdict of them)."""
        return self.args_cls(**fields)


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameter count, a parameter shared by several modules (a tied embedding) once; without
    embeddings it is the N of the 6N FLOP rule, since an embedding lookup does no matmul. A table
    tied to the output projection stays in N: the output's matmul runs on it all the same
    (torchtitan's count drops it, 6 x vocab x dim FLOPs per token short)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        in_matmuls = {
            id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
        }
        total -= sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, nn.Embedding)
            for p in m.parameters()
            if id(p) not in in_matmuls
        )
    return total


def persistent_buffers(model_parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The model's persistent buffers (those of its state dict), named as in it: state that is
    not a parameter but belongs to the model (MoE's expert biases); not the non-persistent ones
    (rotary tables, MoE's per-step token counts)."""
    out = []
    for i, part in enumerate(model_parts):
        for prefix, module in part.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out.append((f"{i}.{prefix}.{name}" if prefix else f"{i}.{name}", buf))
    return out


def synced_buffer_elements(model_parts: list[nn.Module]) -> int:
    """Elements of the floating-point persistent buffers (MoE's expert biases), which DiLoCo
    averages across the replica groups with the pseudo-gradient (train/diloco.py)."""
    return sum(b.numel() for _, b in persistent_buffers(model_parts) if b.is_floating_point())
