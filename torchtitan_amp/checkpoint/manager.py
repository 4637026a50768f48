"""The checkpoint manager: what the trainer holds to save and load everything a run needs to
continue exactly where it stopped. It composes the parts, each owning its own state:

- `parts.py`: the table of stateful parts (`PARTS`) and `RunState`, the live objects it reads and
  writes;
- `ranks.py`: `RankLayout`, this rank's place in the job, and the cross-rank `agree` / `all_ok`;
- `saving.py`: `Saver` (saves, background saves with their stager and group, commits, exports);
- `loading.py`: choosing, verifying and restoring a checkpoint;
- `stopping.py`: the per-step stop poll, on the control group the manager makes;
- `retention.py`: keep_latest_k;
- `replicas.py`: who saves what under fault tolerance (replica groups).

Saving writes `step-N.tmp/`, waits for every rank, then rank 0 writes the marker and renames the
folder to `step-N` (format.py). Also here: the config checks that need the world size or device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan_amp.checkpoint import loading, parts, replicas, stopping
from torchtitan_amp.checkpoint.parts import RunState
from torchtitan_amp.checkpoint.ranks import RankLayout, agree
from torchtitan_amp.checkpoint.saving import Saver, probe_writable
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.config import JobConfig
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.distributed import process_groups

logger = logging.getLogger("torchtitan_amp")


def validate_config(config: JobConfig, world_size: int, device_type: str) -> None:
    """Config checks that need the world size or device (the rest are in config.validate); raises
    ConfigError.

    Args:
        config: the job config.
        world_size: the number of ranks in the job.
        device_type: the training device's type ("cuda", "cpu").
    """
    c = config.checkpoint
    names = [p.name for p in parts.PARTS]  # read at call time: a part added to PARTS counts at once
    unknown = [n for n in c.exclude_from_loading if n not in names]
    if unknown:
        raise ConfigError(
            f"'checkpoint.exclude_from_loading' has unknown state {unknown[0]!r}; choose from: {', '.join(names)}"
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
    d = config.debug
    if d.fault_inject_at_step and not 0 <= d.fault_inject_rank < world_size:
        raise ConfigError(
            f"'debug.fault_inject_rank' = {d.fault_inject_rank} is not a rank of this job (world size {world_size})"
        )


class CheckpointManager:
    """Saves and loads everything a run needs to continue exactly where it stopped.

    `model` may be a list (the pipeline stages this rank holds) and `optimizer` one optimizer
    over all of them or a list (parts.RunState).
    Collective calls (every rank must make them): load, maybe_save, should_stop, close.
    `replica`: this run's replica group under fault tolerance (replicas.py); `outer_state`: its
    DiLoCo state under semi_sync_method = "diloco" (parts.RunState).
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
        replica: replicas.ReplicaGroup | None = None,
        outer_state: Any = None,
    ) -> None:
        c = config.checkpoint
        self.config = config
        self.enabled = c.enable or c.create_seed_checkpoint
        self.folder = Path(config.job.dump_folder) / c.folder
        self.ranks = RankLayout.current(dataloader, pp_degree)
        self.state = RunState(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            scaler=scaler,
            dataloader=dataloader,
            validator=validator,
            model_args=model_args,
            device=device,
            ranks=self.ranks,
            outer_state=outer_state,
        )
        self.loaded_path: Path | None = None  # what load() restored from
        # should_stop's group (gloo even on nccl runs, so the poll never syncs the GPU). Made first,
        # before the saver's, because every rank polls every step, checkpointing on or off.
        self._control_pg = process_groups.control_group(config.comm.timeout_seconds)
        # Under fault tolerance: this replica group, which saves its own files and maybe the shared ones.
        self.replica = replica
        self.saver = Saver(config, self.folder, self.ranks, self.state, enabled=self.enabled, replica=replica)
        if not self.enabled:
            return
        agree(self.ranks, lambda: probe_writable(self.folder))
        if self.ranks.rank == 0:
            logger.info(
                "checkpointing to %s (every %d steps%s, async %s)",
                self.folder,
                c.interval,
                f", keeping the latest {c.keep_latest_k}" if c.keep_latest_k else "",
                c.async_mode,
            )

    @property
    def last_saved_step(self) -> int:
        return self.saver.last_saved_step

    @property
    def last_save_s(self) -> float:
        """Seconds from asking for the last committed save to its commit (Saver.last_save_s)."""
        return self.saver.last_save_s

    def estimate_save_s(self, probe_bytes: int = 64 << 20) -> tuple[int, float]:
        """Bytes and seconds of this rank's share of a full save (Saver.estimate_save_s). Collective."""
        return self.saver.estimate_save_s(probe_bytes)

    def maybe_save(self, step: int, tokens_seen: int, *, last: bool = False, force: bool = False) -> None:
        """Save at every `interval` steps, at the last step, and when forced (preemption).

        Args:
            step: the step just finished.
            tokens_seen: tokens trained on so far, saved in the train state.
            last: whether it is the run's last step (saved whatever the interval, model-only or also as a
                Hugging Face folder when the config asks).
            force: save whatever the interval (a stop signal).
        """
        self.saver.maybe_save(step, tokens_seen, last=last, force=force)

    def export_hf(self, step: int) -> Path:
        """Convert the committed step-N into a Hugging Face folder hf-step-N beside it."""
        return self.saver.export_hf(step)

    def save_seed(self) -> None:
        """Step 0, model only, DCP: any layout can start from it."""
        self.saver.save_seed()

    def save(self, step: int, tokens_seen: int, *, kind: str = "full") -> None:
        """Save step `step` now (Saver.save). Collective.

        Args:
            step: the step the checkpoint is of (its folder is step-<step>).
            tokens_seen: tokens trained on so far, saved in the train state.
            kind: "full" (every part), "model_only" (the model as one file) or "seed" (the model alone, DCP).
        """
        self.saver.save(step, tokens_seen, kind=kind)

    def should_stop(self) -> bool:
        """Whether a stop signal reached any rank (stopping.should_stop). Once per step, every rank."""
        return stopping.should_stop(self.ranks, self._control_pg, self.saver)

    def close(self) -> None:
        """Finish any background save, then shut the pinned-memory stager down. Collective."""
        self.saver.close()

    def load(self) -> TrainState | None:
        """Resume from the newest complete checkpoint (or load_step), else initial_load_path.

        checkpoint.enable governs saving and resuming; initial_load_path is the user's request for
        starting weights, so it is loaded with checkpointing off too (the run's folder unread).
        Returns the restored step and tokens, or None when starting fresh.
        """
        c = self.config.checkpoint
        if c.create_seed_checkpoint or not (self.enabled or c.initial_load_path):
            return None
        restored = loading.load(self.config, self.folder if self.enabled else None, self.state, self.replica)
        if restored is None:
            return None
        self.saver.last_saved_step = restored.train_state.step
        self.loaded_path = restored.path
        return restored.train_state
