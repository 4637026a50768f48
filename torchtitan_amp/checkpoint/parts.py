"""The stateful parts of a checkpoint: one table (`PARTS`) of everything a run needs to continue
exactly where it stopped, and `RunState`, the live objects the table reads and writes. A new
state to save is one entry in the table: saving, loading and `checkpoint.exclude_from_loading`
all read it.

DCP holds the layout-free parts (model and optimizer keyed by FQN, so any parallel layout can load
them, LR schedule, loss scaler, train state, and under DiLoCo its global weights and outer
momentum, placed like the parameters); `rank_<r>.pt` holds each rank's own: RNG states, and
the data position, which is global (samples consumed, the same in every file), so another
data-parallel degree reads it from any rank's file.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_amp.checkpoint.format import check_model_fits, merge_parts
from torchtitan_amp.checkpoint.ranks import RankLayout
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.precision.lora import adapter_parameters

logger = logging.getLogger("torchtitan_amp")

# Flattened optimizer keys ("state.<fqn>.exp_avg") do not depend on param order, which pipeline
# stages need, and make optimizer resharding a pure key match.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------
# The stateful parts


def _always(*_: Any) -> bool:
    return True


@dataclass(frozen=True)
class StatePart:
    """One thing a full checkpoint restores. `get` returns its state (for DCP parts, also the
    template DCP loads into), `put` restores it. DCP parts may refuse (raise CheckpointError) or
    skip (return False, after saying why) in `loadable`, given the saved DCP metadata; per-rank
    parts name the rank whose file holds this rank's state in `source_rank` (None: skip)."""

    name: str
    in_dcp: bool
    get: Callable[[RunState], Any]
    put: Callable[[RunState, Any], object]  # what it returns is ignored
    loadable: Callable[[RunState, Path, dict[str, Any], Any], bool] = _always
    source_rank: Callable[[RunState, Path, dict[str, Any]], int | None] = lambda m, path, meta: m.ranks.rank
    # A per-rank part that checkpoints written before it existed lack: absent there means "nothing
    # to restore", not a damaged file.
    optional: bool = False


def _model_fits(m: RunState, path: Path, saved: dict[str, Any], template: Any) -> bool:
    check_model_fits(path, saved, template, "model.", m.ranks.pp_degree == 1)
    return True


def _has_optimizer(m: RunState, path: Path, saved: dict[str, Any], template: Any) -> bool:
    if not any(k.startswith("optimizer.") for k in saved):
        raise CheckpointError(
            f"{path} has no optimizer state; add 'optimizer' to checkpoint.exclude_from_loading to load it anyway"
        )
    _log_state_dtype_change(m, path, saved, template)
    return True


def _log_state_dtype_change(m: RunState, path: Path, saved: dict[str, Any], template: Any) -> None:
    """AdamW moments saved in one dtype load into a run keeping them in another (optimizer.state_dtype):
    DCP copies into this run's tensors, converting. Say so once, with both dtypes."""
    changes = set()
    for key, now in template.items():
        was = saved.get(f"optimizer.{key}")
        if key.endswith((".exp_avg", ".exp_avg_sq")) and was is not None and isinstance(now, torch.Tensor):
            if was.properties.dtype != now.dtype:
                changes.add((str(was.properties.dtype).removeprefix("torch."), str(now.dtype).removeprefix("torch.")))
    if changes and m.ranks.rank == 0:
        for was_name, now_name in sorted(changes):
            logger.warning(
                "optimizer state in %s was saved in %s; this run keeps it in %s "
                "(optimizer.state_dtype): converted on load",
                path,
                was_name,
                now_name,
            )


def _has_scaler(m: RunState, path: Path, saved: dict[str, Any], template: Any) -> bool:
    if not m.scaler.enabled:
        return False  # an fp16 checkpoint resumed without fp16: nothing to restore
    if not any(k.startswith("scaler.scaler.") for k in saved):
        if m.ranks.rank == 0:
            logger.warning(
                "checkpoint %s has no loss-scaler state (saved without fp16): starting from the configured init_scale",
                path,
            )
        return False
    return True


def _dataloader_source(m: RunState, path: Path, meta: dict[str, Any]) -> int:
    if meta["dp_degree"] == m.ranks.dp_degree:
        sources = [r for r, d in meta["rank_dp"] if d == m.ranks.dp_rank]
        if m.ranks.rank in sources:
            return m.ranks.rank
        if sources:
            return sources[0]
    # The global position: every rank's file holds the same one (also another replica group's
    # files, whose data ranks are not this group's: fault tolerance, replicas.py).
    return 0


def _validation_source(m: RunState, path: Path, meta: dict[str, Any]) -> int | None:
    if m.validator is None or not m.validator.state_dict():
        return None  # validation off, or every evaluation covers the whole split: no position
    return _dataloader_source(m, path, meta)


def _rng_source(m: RunState, path: Path, meta: dict[str, Any]) -> int | None:
    if meta["world_size"] == m.ranks.world_size:
        return m.ranks.rank
    if m.ranks.rank == 0:
        logger.warning(
            "RNG states not restored: %s was saved by %d ranks, this run has %d; every rank keeps "
            "its seeded start state, so random draws (dropout, init of new parts) differ from the "
            "straight run's",
            path,
            meta["world_size"],
            m.ranks.world_size,
        )
    return None


def _put_dataloader(m: RunState, state: dict[str, Any]) -> None:
    m.dataloader.load_state_dict(state)
    note = getattr(m.dataloader, "resume_note", "")
    if note and m.ranks.rank == 0:
        logger.info("%s", note)


def _has_outer_state(m: RunState, path: Path, saved: dict[str, Any], template: Any) -> bool:
    if m.outer_state is None:
        return False  # not DiLoCo: a DiLoCo checkpoint's model and optimizer resume a per-step run
    if not any(k.startswith("diloco.") for k in saved):
        raise CheckpointError(
            f"{path} has no DiLoCo state (saved without fault_tolerance.semi_sync_method = "
            "'diloco'); add 'diloco' to checkpoint.exclude_from_loading to start the global "
            "weights from the loaded model, with zero momentum"
        )
    return True


def _put_train_state(m: RunState, state: dict[str, Any]) -> None:
    m.train_state = TrainState(int(state["step"]), int(state["tokens_seen"]))


# In load order. exclude_from_loading names entries of this table.
PARTS: tuple[StatePart, ...] = (
    StatePart(
        "model", True, lambda m: m.checkpoint_model_state(), lambda m, sd: m.set_checkpoint_model_state(sd), _model_fits
    ),
    StatePart(
        "optimizer",
        True,
        lambda m: get_optimizer_state_dict(m.model, m.optimizers, options=_OPTIM_OPTIONS),
        lambda m, sd: set_optimizer_state_dict(m.model, m.optimizers, sd, options=_OPTIM_OPTIONS),
        _has_optimizer,
    ),
    StatePart(
        "lr_scheduler", True, lambda m: m.lr_scheduler.state_dict(), lambda m, sd: m.lr_scheduler.load_state_dict(sd)
    ),
    StatePart("scaler", True, lambda m: m.scaler.state_dict(), lambda m, sd: m.scaler.load_state_dict(sd), _has_scaler),
    StatePart(
        "diloco",
        True,
        lambda m: m.outer_state.checkpoint_state() if m.outer_state is not None else {},
        lambda m, sd: m.outer_state.load_checkpoint_state(sd),
        _has_outer_state,
    ),
    StatePart("train_state", True, lambda m: dataclasses.asdict(m.train_state), _put_train_state),
    StatePart(
        "dataloader", False, lambda m: m.dataloader.state_dict(), _put_dataloader, source_rank=_dataloader_source
    ),
    StatePart(
        "rng", False, lambda m: _rng_state(m.device), lambda m, s: _set_rng_state(s, m.device), source_rank=_rng_source
    ),
    StatePart(
        "validation",
        False,
        lambda m: m.validator.state_dict() if m.validator is not None else {},
        lambda m, sd: m.validator.load_state_dict(sd),
        source_rank=_validation_source,
        optional=True,
    ),
)


# ---------------------------------------------------------------------------------------------
# The live objects


class RunState:
    """The live objects PARTS reads and writes: this rank's model and optimizers, LR schedule, loss
    scaler, data and validation positions, RNG, and the step count (`train_state`, which the table's
    train_state entry saves and restores).

    `outer_state`: DiLoCo's (train/diloco.py) under fault_tolerance.semi_sync_method = "diloco",
    else None; its `checkpoint_state()` is the "diloco" part (global weights and outer momentum
    as DTensors placed like the parameters, sync counters), `load_checkpoint_state` restores it.

    `model` may be a list (the pipeline stages this rank holds) and `optimizer` one optimizer
    over all of them or a list: the stages are merged into one module for the state_dict
    helpers, which works because stage FQNs never collide.
    """

    model_parts: list[nn.Module]
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    lr_scheduler: Any
    scaler: Any
    dataloader: Any
    validator: Any
    model_args: Any
    device: torch.device
    ranks: RankLayout
    outer_state: Any
    train_state: TrainState
    parts: tuple[StatePart, ...]
    dcp_parts: tuple[StatePart, ...]
    rank_parts: tuple[StatePart, ...]

    def __init__(
        self,
        *,
        model: nn.Module | list[nn.Module],
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        lr_scheduler: Any,
        scaler: Any,
        dataloader: Any,
        validator: Any,
        model_args: Any,
        device: torch.device,
        ranks: RankLayout,
        outer_state: Any = None,
    ) -> None:
        self.model_parts = model if isinstance(model, list) else [model]
        self.model = self.model_parts[0] if len(self.model_parts) == 1 else merge_parts(self.model_parts)
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.dataloader = dataloader
        self.validator = validator
        self.model_args = model_args
        self.device = device
        self.ranks = ranks
        self.outer_state = outer_state
        self.train_state = TrainState()
        self.model_keys = "adapters"  # under LoRA: which keys the "model" part holds ("adapters" / "base")
        self.parts = PARTS  # read once: the table in force when the run started
        self.dcp_parts = tuple(p for p in PARTS if p.in_dcp)
        self.rank_parts = tuple(p for p in PARTS if not p.in_dcp)

    def model_state_dict(self, options: StateDictOptions | None = None) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=options)

    @property
    def adapters(self) -> set[str]:
        """LoRA's adapter keys (empty without [lora])."""
        return set(adapter_parameters(self.model))

    def checkpoint_model_state(self) -> dict[str, Any]:
        """The "model" part: the whole model, or under LoRA the adapters alone (`model_keys`
        "adapters"; the frozen base is the run's initial_load_path or its seed init, recorded in
        the checkpoint's meta) or the base alone ("base": an initial_load_path that holds one)."""
        sd = self.model_state_dict()
        adapters = self.adapters
        if not adapters:
            return sd
        keep = (lambda k: k in adapters) if self.model_keys == "adapters" else (lambda k: k not in adapters)
        return {k: v for k, v in sd.items() if keep(k)}

    def set_checkpoint_model_state(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=not self.adapters))

    def dcp_state(self, names: tuple[str, ...], train_state: TrainState) -> dict[str, Any]:
        """The DCP parts among `names`, as state dicts (also the templates DCP loads into)."""
        self.train_state = train_state
        return {p.name: p.get(self) for p in self.dcp_parts if p.name in names}

    def rank_state(self) -> dict[str, Any]:
        """This rank's file: where the rank sat in the job, then its per-rank parts."""
        r = self.ranks
        return {
            "rank": r.rank,
            "dp_rank": r.dp_rank,
            "dp_degree": r.dp_degree,
            "world_size": r.world_size,
            **{p.name: p.get(self) for p in self.rank_parts},
        }
