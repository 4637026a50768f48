"""The checkpoint manager: saves and loads everything a run needs to continue exactly where it
stopped, driven by one table of stateful parts (`PARTS`): a new state to save is one entry.

Saving writes `step-N.tmp/`, waits for every rank, then rank 0 writes the marker and renames the
folder to `step-N` (format.py). DCP holds the layout-free parts (model and optimizer keyed by FQN,
so any parallel layout can load them, LR schedule, loss scaler, train state); `rank_<r>.pt`
holds each rank's own: RNG states, and the data position, which is global (samples consumed, the
same in every file), so another data-parallel degree reads it from any rank's file.

This module holds the table, the manager's construction and its collective helpers; the jobs are
in saving.py (saves, commits, exports), loading.py (choosing and restoring a checkpoint),
retention.py (keep_latest_k) and stopping.py (the per-step stop poll, close).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_amp.checkpoint import loading, saving, stopping
from torchtitan_amp.checkpoint.format import check_model_fits, merge_parts, one_line
from torchtitan_amp.checkpoint.saving import PendingSave
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.config import JobConfig
# Looked up here when the manager is made (tests replace it through this module).
from torchtitan_amp.core.errors import CheckpointError, ConfigError
from torchtitan_amp.distributed.process_groups import control_group

logger = logging.getLogger("torchtitan_amp")

# Flattened optimizer keys ("state.<fqn>.exp_avg") do not depend on param order, which pipeline
# stages need, and make optimizer resharding a pure key match.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)



def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
    get: Callable[["CheckpointManager"], Any]
    put: Callable[["CheckpointManager", Any], None]
    loadable: Callable[["CheckpointManager", Path, dict[str, Any], Any], bool] = _always
    source_rank: Callable[["CheckpointManager", Path, dict[str, Any]], int | None] = lambda m, path, meta: m.rank
    # A per-rank part that checkpoints written before it existed lack: absent there means "nothing
    # to restore", not a damaged file.
    optional: bool = False


def _model_fits(m: "CheckpointManager", path: Path, saved: dict[str, Any], template: Any) -> bool:
    check_model_fits(path, saved, template, "model.", m.pp_degree == 1)
    return True


def _has_optimizer(m: "CheckpointManager", path: Path, saved: dict[str, Any], template: Any) -> bool:
    if not any(k.startswith("optimizer.") for k in saved):
        raise CheckpointError(f"{path} has no optimizer state; add 'optimizer' to "
                              "checkpoint.exclude_from_loading to load it anyway")
    _log_state_dtype_change(m, path, saved, template)
    return True


def _log_state_dtype_change(m: "CheckpointManager", path: Path, saved: dict[str, Any], template: Any) -> None:
    """AdamW moments saved in one dtype load into a run keeping them in another (optimizer.state_dtype):
    DCP copies into this run's tensors, converting. Say so once, with both dtypes."""
    changes = set()
    for key, now in template.items():
        was = saved.get(f"optimizer.{key}")
        if key.endswith((".exp_avg", ".exp_avg_sq")) and was is not None and isinstance(now, torch.Tensor):
            if was.properties.dtype != now.dtype:
                changes.add((str(was.properties.dtype).removeprefix("torch."), str(now.dtype).removeprefix("torch.")))
    if changes and m.rank == 0:
        for was_name, now_name in sorted(changes):
            logger.warning("optimizer state in %s was saved in %s; this run keeps it in %s "
                        "(optimizer.state_dtype): converted on load", path, was_name, now_name)


def _has_scaler(m: "CheckpointManager", path: Path, saved: dict[str, Any], template: Any) -> bool:
    if not m.scaler.enabled:
        return False  # an fp16 checkpoint resumed without fp16: nothing to restore
    if not any(k.startswith("scaler.scaler.") for k in saved):
        if m.rank == 0:
            logger.warning("checkpoint %s has no loss-scaler state (saved without fp16): "
                           "starting from the configured init_scale", path)
        return False
    return True


def _dataloader_source(m: "CheckpointManager", path: Path, meta: dict[str, Any]) -> int:
    if meta["dp_degree"] == m.dp_degree:
        sources = [r for r, d in meta["rank_dp"] if d == m.dp_rank]
        return m.rank if m.rank in sources else sources[0]
    if meta.get("data_order") != "global":
        raise CheckpointError(
            f"{path} was saved with data-parallel degree {meta['dp_degree']} but this run has "
            f"{m.dp_degree}: its data position is per rank (saved before the global data order) and "
            "cannot be resharded; add 'dataloader' to checkpoint.exclude_from_loading to restart the data stream"
        )
    return 0  # the global position: every rank's file holds the same one


def _validation_source(m: "CheckpointManager", path: Path, meta: dict[str, Any]) -> int | None:
    if m.validator is None or not m.validator.state_dict():
        return None  # validation off, or every evaluation covers the whole split: no position
    if meta["dp_degree"] != m.dp_degree and meta.get("data_order") != "global":
        if m.rank == 0:
            logger.warning("validation position not restored: %s was saved with data-parallel degree %d, "
                           "this run has %d, and holds per-rank positions", path, meta["dp_degree"], m.dp_degree)
        return None
    return _dataloader_source(m, path, meta)


def _rng_source(m: "CheckpointManager", path: Path, meta: dict[str, Any]) -> int | None:
    if meta["world_size"] == m.world_size:
        return m.rank
    if m.rank == 0:
        logger.warning("RNG states not restored: %s was saved by %d ranks, this run has %d; every rank keeps "
                       "its seeded start state, so random draws (dropout, init of new parts) differ from the "
                       "straight run's", path, meta["world_size"], m.world_size)
    return None


def _put_dataloader(m: "CheckpointManager", state: dict[str, Any]) -> None:
    m.dataloader.load_state_dict(state)
    note = getattr(m.dataloader, "resume_note", "")
    if note and m.rank == 0:
        logger.info("%s", note)


def _put_train_state(m: "CheckpointManager", state: dict[str, Any]) -> None:
    m.train_state = TrainState(int(state["step"]), int(state["tokens_seen"]))


# In load order. exclude_from_loading names entries of this table.
PARTS: tuple[StatePart, ...] = (
    StatePart("model", True, lambda m: m._model_state_dict(),
              lambda m, sd: set_model_state_dict(m._model, sd), _model_fits),
    StatePart("optimizer", True,
              lambda m: get_optimizer_state_dict(m._model, m.optimizers, options=_OPTIM_OPTIONS),
              lambda m, sd: set_optimizer_state_dict(m._model, m.optimizers, sd, options=_OPTIM_OPTIONS),
              _has_optimizer),
    StatePart("lr_scheduler", True, lambda m: m.lr_scheduler.state_dict(),
              lambda m, sd: m.lr_scheduler.load_state_dict(sd)),
    StatePart("scaler", True, lambda m: m.scaler.state_dict(), lambda m, sd: m.scaler.load_state_dict(sd),
              _has_scaler),
    StatePart("train_state", True, lambda m: dataclasses.asdict(m.train_state), _put_train_state),
    StatePart("dataloader", False, lambda m: m.dataloader.state_dict(),
              _put_dataloader, source_rank=_dataloader_source),
    StatePart("rng", False, lambda m: _rng_state(m.device), lambda m, s: _set_rng_state(s, m.device),
              source_rank=_rng_source),
    StatePart("validation", False, lambda m: m.validator.state_dict() if m.validator is not None else {},
              lambda m, sd: m.validator.load_state_dict(sd), source_rank=_validation_source, optional=True),
)


# ---------------------------------------------------------------------------------------------
# Config checks that need the world size or device (the rest are in config.validate)


def validate_config(config: JobConfig, world_size: int, device_type: str) -> None:
    c = config.checkpoint
    names = [p.name for p in PARTS]  # read at call time: a part added to PARTS counts at once
    unknown = [n for n in c.exclude_from_loading if n not in names]
    if unknown:
        raise ConfigError(
            f"'checkpoint.exclude_from_loading' has unknown state {unknown[0]!r}; "
            f"choose from: {', '.join(names)}"
        )
    if c.async_mode == "async_with_pinned_mem" and device_type != "cuda":
        raise ConfigError(
            "'checkpoint.async_mode' = 'async_with_pinned_mem' needs CUDA (pinned host memory for "
            f"device-to-host copies); on {device_type} use 'async' or 'disabled'"
        )
    if c.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"'checkpoint.create_seed_checkpoint' must run on one process (world size is {world_size}): "
            "the seed is layout-free and every layout loads it"
        )
    t = config.training
    if t.fault_inject_at_step and not 0 <= t.fault_inject_rank < world_size:
        raise ConfigError(
            f"'training.fault_inject_rank' = {t.fault_inject_rank} is not a rank of this job "
            f"(world size {world_size})"
        )


# ---------------------------------------------------------------------------------------------
# The manager


class CheckpointManager:
    """Saves and loads everything a run needs to continue exactly where it stopped.

    `model` may be a list (the pipeline stages this rank holds) and `optimizer` one optimizer
    over all of them or a list: the stages are merged into one module for the state_dict
    helpers, which works because stage FQNs never collide.
    Collective calls (every rank must make them): load, maybe_save, should_stop, close.
    """

    def __init__(
        self,
        config: JobConfig,
        *,
        model: nn.Module | list[nn.Module],
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        lr_scheduler: Any,
        scaler: Any,
        dataloader: Any,
        model_args: Any,
        device: torch.device,
        pp_degree: int = 1,
        validator: Any = None,
    ) -> None:
        c = config.checkpoint
        self.config = config
        self.enabled = c.enable or c.create_seed_checkpoint
        self.model_parts = model if isinstance(model, list) else [model]
        self._model = self.model_parts[0] if len(self.model_parts) == 1 else merge_parts(self.model_parts)
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.dataloader = dataloader
        self.validator = validator
        self.model_args = model_args
        self.device = device
        self.pp_degree = pp_degree
        self.folder = Path(config.job.dump_folder) / c.folder
        self.rank = _rank()
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # The mesh is row-major with pp outermost: each stage owns a contiguous block of ranks.
        self.stage_ranks = self.world_size // pp_degree
        self.pp_rank = self.rank // self.stage_ranks
        self.dp_rank = getattr(dataloader, "dp_rank", 0)
        self.dp_degree = getattr(dataloader, "dp_world_size", 1)
        self.last_saved_step = -1
        self.loaded_path: Path | None = None  # what load() restored from
        # Seconds from asking for the last committed save to its commit (async: an upper bound,
        # the steps that overlapped the write are counted too).
        self.last_save_s = 0.0
        self.train_state = TrainState()  # what PARTS' train_state entry saves and restores
        self.parts = PARTS  # read once: the table in force when the run started
        self.dcp_parts = tuple(p for p in PARTS if p.in_dcp)
        self.rank_parts = tuple(p for p in PARTS if not p.in_dcp)
        self._pending: PendingSave | None = None
        self._stager: Any = None  # async_with_pinned_mem's DefaultStager, one per run (saving.pinned_stager)
        self._async_pg = None
        # should_stop's group (gloo even on nccl runs, so the poll never syncs the GPU). Made here,
        # before the return below, because every rank polls every step, checkpointing on or off.
        self._control_pg = control_group(config.comm.timeout_seconds)
        if not self.enabled:
            return
        if c.async_mode != "disabled" and dist.is_initialized():
            # The upload thread's collectives must not interleave with training's on the default group.
            self._async_pg = dist.new_group(backend="gloo")
        self._agree(self._probe_writable)
        if self.rank == 0:
            logger.info("checkpointing to %s (every %d steps%s, async %s)", self.folder, c.interval,
                        f", keeping the latest {c.keep_latest_k}" if c.keep_latest_k else "", c.async_mode)

    # -----------------------------------------------------------------------------------------
    # Collective helpers

    def _agree(self, fn: Callable[[], Any]) -> Any:
        """Run fn on rank 0 and hand every rank its result, or raise its error on every rank."""
        result: list[Any] = [None, None]
        if self.rank == 0:
            try:
                result = [fn(), None]
            except (CheckpointError, OSError) as e:
                result = [None, str(e) if isinstance(e, CheckpointError) else one_line(e)]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        if result[1] is not None:
            raise CheckpointError(result[1])
        return result[0]

    def _all_ok(self, error: str | None, extra: Any = None) -> list[Any]:
        """Gather (error, extra) from every rank; raise the first error everywhere."""
        gathered: list[Any] = [(error, extra)]
        if dist.is_initialized() and self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, (error, extra))
        errors = [e for e, _ in gathered if e is not None]
        if errors:
            raise CheckpointError(errors[0])
        return [x for _, x in gathered]

    def _probe_writable(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".write_probe_{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(
                f"checkpoint folder {self.folder} is not writable: {e.strerror or one_line(e)}"
            ) from None

    # -----------------------------------------------------------------------------------------
    # State dicts

    def _model_state_dict(self, options: StateDictOptions | None = None) -> dict[str, Any]:
        return get_model_state_dict(self._model, options=options)

    def _dcp_state(self, names: tuple[str, ...], train_state: TrainState) -> dict[str, Any]:
        """The DCP parts among `names`, as state dicts (also the templates DCP loads into)."""
        self.train_state = train_state
        return {p.name: p.get(self) for p in self.dcp_parts if p.name in names}

    def _rank_state(self) -> dict[str, Any]:
        return {"rank": self.rank, "dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
                "world_size": self.world_size, **{p.name: p.get(self) for p in self.rank_parts}}

    # -----------------------------------------------------------------------------------------
    # The jobs, each in its own module (module docstring)

    def estimate_save_s(self, probe_bytes: int = 64 << 20) -> tuple[int, float]:
        """Bytes and seconds of this rank's share of a full save (saving.estimate_save_s). Collective."""
        return saving.estimate_save_s(self, probe_bytes)

    def maybe_save(self, step: int, tokens_seen: int, *, last: bool = False, force: bool = False) -> None:
        """Save at every `interval` steps, at the last step, and when forced (preemption)."""
        saving.maybe_save(self, step, tokens_seen, last=last, force=force)

    def export_hf(self, step: int) -> Path:
        """Convert the committed step-N into a Hugging Face folder hf-step-N beside it."""
        return saving.export_hf(self, step)

    def save_seed(self) -> None:
        """Step 0, model only, DCP: any layout can start from it."""
        saving.save_seed(self)

    def save(self, step: int, tokens_seen: int, *, kind: str = "full") -> None:
        saving.save(self, step, tokens_seen, kind=kind)

    def _commit(self, state: TrainState, tmp: Path, final: Path, kind: str, begin: float) -> None:
        # A method, so that a test can replace it (tests/workers/ckpt_jobs.py crashes mid-commit).
        saving.commit(self, state, tmp, final, kind, begin)

    def should_stop(self) -> bool:
        """Whether a stop signal reached any rank (stopping.should_stop). Once per step, every rank."""
        return stopping.should_stop(self)

    def close(self) -> None:
        """Finish any background save, then shut the pinned-memory stager down. Collective."""
        stopping.close(self)

    def load(self) -> TrainState | None:
        """Resume from the newest complete checkpoint (or load_step), else initial_load_path.

        Returns the restored step and tokens, or None when starting fresh.
        """
        return loading.load(self)
