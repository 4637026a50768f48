"""The checkpoint manager: saves and loads everything a run needs to continue exactly where it
stopped, driven by one table of stateful parts (`PARTS`): a new state to save is one entry.

Saving writes `step-N.tmp/`, waits for every rank, then rank 0 writes the marker and renames the
folder to `step-N` (format.py). DCP holds the layout-free parts (model and optimizer keyed by FQN,
so any parallel layout can load them, LR schedule, loss scaler, train state); `rank_<r>.pt`
holds each rank's own (dataloader position keyed by data-parallel rank, RNG states).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtitan_amp.distributed import control_group
from torchtitan_amp.distributed import local_tensor as _local
from torchtitan_amp.checkpoint.format import (
    EXPORT_FILE,
    FORMAT_VERSION,
    MARKER,
    TORCH_DTYPES,
    check_model_fits,
    describe_steps,
    dir_sizes,
    inspect_checkpoint,
    merge_export_parts,
    merge_parts,
    one_line,
    quiet_single_process,
    scan_folder,
)
from torchtitan_amp.checkpoint.integrity import file_crc32, verify_checksums
from torchtitan_amp.config import JobConfig
from torchtitan_amp.errors import CheckpointError, ConfigError
from torchtitan_amp.run_control import stop_requested
from torchtitan_amp.torch_compat import default_stager_reusable

logger = logging.getLogger("torchtitan_amp")

# Flattened optimizer keys ("state.<fqn>.exp_avg") do not depend on param order, which pipeline
# stages need, and make optimizer resharding a pure key match.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0



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
    if meta["dp_degree"] != m.dp_degree:
        raise CheckpointError(
            f"{path} was saved with data-parallel degree {meta['dp_degree']} but this run has "
            f"{m.dp_degree}: the data position cannot be resharded; add 'dataloader' to "
            "checkpoint.exclude_from_loading to restart the data stream"
        )
    sources = [r for r, d in meta["rank_dp"] if d == m.dp_rank]
    return m.rank if m.rank in sources else sources[0]


def _validation_source(m: "CheckpointManager", path: Path, meta: dict[str, Any]) -> int | None:
    if m.validator is None or not m.validator.state_dict():
        return None  # validation off, or every evaluation covers the whole split: no position
    if meta["dp_degree"] != m.dp_degree:
        if m.rank == 0:
            logger.warning("validation position not restored: %s was saved with data-parallel degree %d, "
                           "this run has %d", path, meta["dp_degree"], m.dp_degree)
        return None
    return _dataloader_source(m, path, meta)


def _rng_source(m: "CheckpointManager", path: Path, meta: dict[str, Any]) -> int | None:
    if meta["world_size"] == m.world_size:
        return m.rank
    if m.rank == 0:
        logger.warning("RNG states not restored: %s was saved by %d ranks, this run has %d",
                       path, meta["world_size"], m.world_size)
    return None


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
              lambda m, sd: m.dataloader.load_state_dict(sd), source_rank=_dataloader_source),
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


class _Choice(NamedTuple):
    """The checkpoint rank 0 picked to load (broadcast to every rank)."""
    path: str
    kind: str
    meta: dict[str, Any]
    initial: bool  # from checkpoint.initial_load_path: weights only, no fallback
    step: int


@dataclass
class _PendingSave:
    future: Future
    state: TrainState
    tmp: Path
    final: Path
    kind: str
    started: float


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
        self._pending: _PendingSave | None = None
        self._stager: Any = None  # async_with_pinned_mem's DefaultStager, one per run (_pinned_stager)
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

    def estimate_save_s(self, probe_bytes: int = 64 << 20) -> tuple[int, float]:
        """(bytes, seconds) of this rank's share of a full save, the slowest rank's time: the
        parameters plus AdamW's two moments (the optimizer state is created by the first step, so
        it is counted from the parameters) at the rate of a timed, fsynced write of up to
        `probe_bytes` into the checkpoint folder. Random bytes, so a compressing filesystem
        cannot flatter it. Collective."""
        size = 3 * sum(_local(p).numel() * _local(p).element_size()
                       for m in self.model_parts for p in m.parameters())
        n = max(min(size, probe_bytes), 1)
        path = self.folder / f".rate_probe_{self.rank}_{os.getpid()}"
        data = os.urandom(n)
        start = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        seconds = (time.perf_counter() - start) * size / n
        path.unlink()
        if dist.is_initialized() and self.world_size > 1:
            t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = float(t.item())
        return size, seconds

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
    # Saving

    def maybe_save(self, step: int, tokens_seen: int, *, last: bool = False, force: bool = False) -> None:
        """Save at every `interval` steps, at the last step, and when forced (preemption)."""
        if not self.enabled or step == self.last_saved_step:
            return
        if not (force or last or step % self.config.checkpoint.interval == 0):
            return
        kind = "model_only" if last and self.config.checkpoint.last_save_model_only else "full"
        self.save(step, tokens_seen, kind=kind)
        if last and self.config.checkpoint.last_save_hf:
            self.export_hf(step)

    def export_hf(self, step: int) -> Path:
        """Convert the committed step-N into a Hugging Face folder hf-step-N beside it. Rank 0
        converts (one shard at a time, from the files: no rank holds the model twice); the others
        wait for its outcome."""
        from torchtitan_amp.checkpoint.hf import export_hf  # needs safetensors, only when asked

        self._finish_pending()
        out = self.folder / f"hf-step-{step}"
        begin = time.monotonic()
        self._agree(lambda: export_hf(self.folder / f"step-{step}", out, self.config.checkpoint.export_dtype))
        if self.rank == 0:
            logger.info("step %d: Hugging Face export in %s (%.2f s)", step, out, time.monotonic() - begin)
        return out

    def save_seed(self) -> None:
        """Step 0, model only, DCP: any layout can start from it."""
        if (self.folder / "step-0").exists():
            raise CheckpointError(f"{self.folder / 'step-0'} already exists; remove it to create a new seed")
        self.save(0, 0, kind="seed")

    @torch.no_grad()
    def save(self, step: int, tokens_seen: int, *, kind: str = "full") -> None:
        self._finish_pending()
        begin = time.monotonic()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        self._agree(lambda: self._prepare_tmp(tmp))
        state = TrainState(step, tokens_seen)
        if kind == "model_only":
            self._write_export(tmp)
            self._commit(state, tmp, final, kind, begin)
            return
        names = ("model",) if kind == "seed" else tuple(p.name for p in self.dcp_parts)
        sd = self._dcp_state(names, state)
        error = None
        if kind == "full":
            try:
                torch.save(self._rank_state(), tmp / f"rank_{self.rank}.pt")
            except OSError as e:
                error = f"rank {self.rank} could not write {tmp}/rank_{self.rank}.pt: {one_line(e)}"
        self._all_ok(error)
        if self.config.checkpoint.async_mode == "disabled" or kind == "seed":
            with quiet_single_process():
                dcp.save(sd, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
            self._commit(state, tmp, final, kind, begin)
        else:
            self._pending = _PendingSave(self._async_save(sd, tmp), state, tmp, final, kind, begin)
            self.last_saved_step = step
            if self.rank == 0:
                logger.info("step %d: checkpoint staged in %.2f s, writing in the background", step,
                            time.monotonic() - begin)

    def _async_save(self, sd: dict[str, Any], tmp: Path) -> Future:
        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "process_group": self._async_pg,
                                  "no_dist": not dist.is_initialized()}
        if self.config.checkpoint.async_mode == "async_with_pinned_mem":
            kwargs["async_stager"] = self._pinned_stager()
        with quiet_single_process():
            response = dcp.async_save(sd, **kwargs)
        if isinstance(response, Future):
            return response
        # An AsyncSaveResponse: the next optimizer step must not run before staging has copied
        # the tensors, so wait for it here; only the upload overlaps training.
        response.staging_completion.result()
        return response.upload_completion

    def _pinned_stager(self) -> Any:
        """The run's one stager, made at the first save: its pinned host copies are reused by every
        save, and close() shuts it down. One per save would pin the whole state again and leak a
        thread each time. Reuse is safe: a save first finishes the previous one, whose upload
        reads those copies. Where torch's stager serves one save only (torch_compat, 2.11), it is
        closed once its save is committed and the next save makes another."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=True))
        return self._stager

    def _write_export(self, tmp: Path) -> None:
        """The full model as one torch.save file in export_dtype. Every rank takes part.

        The first rank of each pipeline stage gathers its stages' tensors one at a time (so a
        rank holds at most one unsharded tensor on the device beyond its shards) and writes
        them; with several stages rank 0 then merges the parts into model.pt.
        """
        dtype = TORCH_DTYPES[self.config.checkpoint.export_dtype]
        writer = self.rank % self.stage_ranks == 0
        part: dict[str, torch.Tensor] = {}
        for key, value in self._model_state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if writer:
                part[key] = (full.to(dtype) if full.is_floating_point() else full).cpu()
        name = EXPORT_FILE if self.pp_degree == 1 else f"model.stage{self.pp_rank}.pt"
        error = None
        if writer:
            try:
                torch.save(part, tmp / name)
            except OSError as e:
                error = f"could not write {tmp / name}: {one_line(e)}"
        self._all_ok(error)
        if self.pp_degree > 1:
            self._agree(lambda: merge_export_parts(tmp, self.pp_degree, self.model_args))

    def _prepare_tmp(self, tmp: Path) -> None:
        # No save is in flight (pending async saves were finished), so any .tmp is a dead one.
        for stale in self.folder.glob("step-*.tmp"):
            logger.info("removing %s, left by a save that never finished", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)

    def _commit(self, state: TrainState, tmp: Path, final: Path, kind: str, begin: float) -> None:
        """Every rank has finished writing: rank 0 writes the marker and renames tmp -> final."""
        crcs, error = self._checksum_share(tmp)
        gathered = self._all_ok(error, (self.rank, self.dp_rank, crcs))
        rank_dp = [(r, d) for r, d, _ in gathered]
        meta = {
            "format": FORMAT_VERSION, "step": state.step, "tokens_seen": state.tokens_seen, "kind": kind,
            "world_size": self.world_size,
            "dp_degree": self.dp_degree, "rank_dp": sorted(rank_dp),
            "model_args": dataclasses.asdict(self.model_args),
            "export_dtype": self.config.checkpoint.export_dtype if kind == "model_only" else None,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
            "job_config": self.config.to_dict(),
        }
        if self.config.checkpoint.checksums:
            meta["crc32"] = {name: crc for *_, share in gathered for name, crc in sorted(share.items())}

        def publish_and_purge() -> None:  # rank 0; one broadcast hands every rank the outcome
            self._publish(tmp, final, meta)
            logger.info("saved %s checkpoint %s in %.2f s", kind, final, time.monotonic() - begin)
            self._purge(state.step)

        self._agree(publish_and_purge)
        self.last_saved_step = state.step
        self.last_save_s = time.monotonic() - begin

    def _checksum_share(self, tmp: Path) -> tuple[dict[str, str], str | None]:
        """CRC-32s of this rank's share of the files in tmp (ranks split them, so the cost is
        about one read of 1/world of the checkpoint per rank)."""
        if not self.config.checkpoint.checksums:
            return {}, None
        names = self._agree(lambda: sorted(dir_sizes(tmp)))
        try:
            return {n: file_crc32(tmp / n) for n in names[self.rank::self.world_size]}, None
        except OSError as e:
            return {}, f"rank {self.rank} could not checksum {tmp}: {one_line(e)}"

    def _publish(self, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        meta["files"] = dir_sizes(tmp)
        with open(tmp / MARKER, "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            try:
                old = inspect_checkpoint(final)
                bad = verify_checksums(final, old.meta)
                if bad:
                    raise CheckpointError(bad)
                aside = final.with_name(final.name + ".replaced")
                logger.warning("replacing existing checkpoint %s", final)
            except CheckpointError:
                aside = final.with_name(final.name + ".corrupt")
                logger.warning("%s exists but is not a complete checkpoint; keeping it as %s", final, aside.name)
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
            os.rename(tmp, final)
            if aside.name.endswith(".replaced"):
                shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _purge(self, saved_step: int) -> None:
        """keep_latest_k counts full checkpoints only; it runs after a newer one is complete.

        Checkpoints of later steps than the one just saved (left by a run resumed from an older
        step: a load_step, or a newer checkpoint that failed its checksum) are neither counted
        nor removed: counting them would delete the checkpoint just written.
        """
        k = self.config.checkpoint.keep_latest_k
        if not k:
            return
        complete, _ = scan_folder(self.folder)
        full = sorted(s for s, info in complete.items() if info.kind == "full" and s <= saved_step)
        for step in full[:-k]:
            path = self.folder / f"step-{step}"
            doomed = path.with_name(path.name + ".deleting")
            os.rename(path, doomed)  # a half-deleted folder must never look like a checkpoint
            shutil.rmtree(doomed, ignore_errors=True)
            logger.info("removed %s (keep_latest_k = %d)", path, k)

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = None
        try:
            pending.future.result()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"background save of {pending.tmp} failed: {one_line(e)}"
        if self._stager is not None and not default_stager_reusable():
            self._close_stager()
        self._all_ok(error)
        self._commit(pending.state, pending.tmp, pending.final, pending.kind, pending.started)

    # -----------------------------------------------------------------------------------------
    # Per-step agreement and shutdown

    def should_stop(self) -> bool:
        """All ranks agree (one tiny all-reduce) whether a stop signal reached any of them; a
        finished background save is committed here too. Call once per step on every rank.

        The flags travel as a CPU tensor on a gloo group (distributed.control_group): reading
        the result back never waits for the GPU."""
        stop = stop_requested()
        signum = int(signal.Signals[stop]) if stop else 0
        flags = [signum, int(self._pending is not None and not self._pending.future.done())]
        if dist.is_initialized() and self.world_size > 1:
            t = torch.tensor(flags, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control_pg)
            flags = [int(x) for x in t.tolist()]
        signum, still_writing = flags
        if self._pending is not None and not still_writing:
            self._finish_pending()
        if signum and self.rank == 0:
            logger.warning("stop requested (%s on some rank): %s", signal.Signals(signum).name,
                           "saving a checkpoint and exiting" if self.enabled else
                           "exiting after this step (checkpoint.enable is false: nothing is saved)")
        return bool(signum)

    def close(self) -> None:
        """Finish any background save, then shut the pinned-memory stager down. Collective."""
        self._finish_pending()
        self._close_stager()

    def _close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # -----------------------------------------------------------------------------------------
    # Loading

    @torch.no_grad()
    def load(self) -> TrainState | None:
        """Resume from the newest complete checkpoint (or load_step), else initial_load_path.

        Returns the restored step and tokens, or None when starting fresh.
        """
        c = self.config.checkpoint
        if not self.enabled or c.create_seed_checkpoint:
            return None
        choice = self._choose_verified()
        if choice is None:
            return None
        path, kind, meta, initial = Path(choice.path), choice.kind, choice.meta, choice.initial
        begin = time.monotonic()
        every = tuple(p.name for p in self.parts)
        names = tuple(n for n in (("model",) if initial or kind != "full" else every)
                      if n not in c.exclude_from_loading)
        state = TrainState()
        if kind == "hf":
            from torchtitan_amp.checkpoint.hf import load_hf  # needs safetensors, only for HF folders

            load_hf(self._model, path, self.model_args, complete_model=self.pp_degree == 1,
                    agree=lambda error: self._all_ok(error))
        elif kind == "model_only":
            self._load_export(path)
        else:
            state = self._load_dcp(path, names)
        if kind == "full":
            self._load_rank_state(path, meta, names)
        if self.rank == 0:
            skipped = [n for n in every if n not in names]
            logger.info("loaded %s (%s) in %.2f s: resuming at step %d%s", path, ", ".join(names),
                        time.monotonic() - begin, state.step,
                        f"; not loaded: {', '.join(skipped)}" if skipped and kind == "full" else "")
        self.last_saved_step = state.step
        self.loaded_path = path
        return state

    def _choose_verified(self) -> _Choice | None:
        """Rank 0 picks a checkpoint, every rank checks the CRC-32s of a share of its files; a
        corrupt one is named and the next older one is tried (unless it was asked for by name)."""
        corrupt: dict[int, str] = {}
        while True:
            choice = self._agree(lambda: self._choose(corrupt))
            if choice is None or not self.config.checkpoint.checksums:
                return choice
            share = verify_checksums(choice.path, choice.meta, (self.rank, self.world_size))
            bad = next((b for b in self._all_ok(None, share) if b), None)
            if bad is None:
                return choice
            if choice.initial:
                raise CheckpointError(f"checkpoint.initial_load_path: {bad}")
            if self.rank == 0:
                logger.warning("checkpoint: skipping %s", bad)
            corrupt[choice.step] = bad

    def _choose(self, corrupt: dict[int, str]) -> _Choice | None:
        """Rank 0 picks the checkpoint; every rank then loads the same one. `corrupt`: steps
        that failed their checksum, with the reason (already logged)."""
        c = self.config.checkpoint
        complete, problems = scan_folder(self.folder)
        if not corrupt:
            for line in problems:
                logger.warning("checkpoint: %s", line)
        for step, why in corrupt.items():
            complete.pop(step, None)
            problems.append(f"skipping {why}")
        if c.load_step >= 0:
            info = complete.get(c.load_step)
            if info is None:
                broken = [p for p in problems if f"step-{c.load_step}" in p]
                why = f" ({broken[0]})" if broken else ""
                raise CheckpointError(
                    f"checkpoint.load_step = {c.load_step}: no complete checkpoint step-{c.load_step} in "
                    f"{self.folder}{why}; available steps: {describe_steps(complete)}"
                )
            if info.kind == "model_only":
                raise CheckpointError(
                    f"checkpoint.load_step = {c.load_step}: {info.path} is a model-only export, not a resume "
                    f"point; use checkpoint.initial_load_path = '{info.path}' to start from its weights"
                )
            return _Choice(str(info.path), info.kind, info.meta, False, info.step)
        resumable = {s: i for s, i in complete.items() if i.kind != "model_only"}
        if resumable:
            info = resumable[max(resumable)]
            newer = [s for s in complete if s > info.step]
            if newer:
                logger.info("checkpoint: step-%s is a model-only export, not a resume point", newer[0])
            if problems:
                logger.warning("checkpoint: resuming from the newest complete checkpoint, %s", info.path)
            return _Choice(str(info.path), info.kind, info.meta, False, info.step)
        if c.initial_load_path:
            return self._choose_initial(Path(c.initial_load_path))
        if problems:
            logger.warning("checkpoint: no complete checkpoint in %s; starting from scratch", self.folder)
        return None

    def _choose_initial(self, path: Path) -> _Choice:
        if not path.exists():
            raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
        if (path / MARKER).is_file():
            info = inspect_checkpoint(path)
            return _Choice(str(path), info.kind, info.meta, True, info.step)
        if (path / "config.json").is_file():  # a Hugging Face model folder
            from torchtitan_amp.checkpoint.hf import check_config

            check_config(path, self.model_args, self.config.model.flavor)
            return _Choice(str(path), "hf", {}, True, 0)
        if (path / ".metadata").is_file():  # a DCP checkpoint written by another tool
            return _Choice(str(path), "seed", {}, True, 0)
        complete, problems = scan_folder(path)
        for line in problems:
            logger.warning("checkpoint: %s", line)
        if not complete:
            raise CheckpointError(f"checkpoint.initial_load_path {path} holds no complete checkpoint")
        info = complete[max(complete)]
        return _Choice(str(info.path), info.kind, info.meta, True, info.step)

    def _load_dcp(self, path: Path, names: tuple[str, ...]) -> TrainState:
        """Load the DCP parts among `names`; the saved TrainState, or a fresh one without it."""
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        sd = self._dcp_state(names, TrainState())
        error = None
        try:
            for part in self.dcp_parts:
                if part.name in sd and not part.loadable(self, path, saved, sd[part.name]):
                    sd.pop(part.name)
        except CheckpointError as e:
            error = str(e)
        self._all_ok(error)
        try:
            with quiet_single_process():
                dcp.load(sd, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        except Exception as e:  # noqa: BLE001 - DCP raises a CheckpointException on every rank
            raise CheckpointError(f"could not load {path}: {one_line(e)}") from None
        self.train_state = TrainState()
        for part in self.dcp_parts:
            if part.name in sd:
                part.put(self, sd[part.name])
        return self.train_state

    def _load_export(self, path: Path) -> None:
        """A model-only export (full tensors, maybe another dtype) as starting weights."""
        sd = torch.load(path / EXPORT_FILE, map_location="cpu", weights_only=True, mmap=True)
        error = None
        try:
            own = self._model_state_dict()
            for key, value in own.items():
                if key not in sd or tuple(sd[key].shape) != tuple(value.shape):
                    got = tuple(sd[key].shape) if key in sd else "nothing"
                    raise CheckpointError(f"{path} does not fit this model: '{key}' has shape {got} in the "
                                          f"export but {tuple(value.shape)} in the model")
        except CheckpointError as e:
            error = str(e)
        self._all_ok(error)
        mine = {k: v for k, v in sd.items() if k in own}
        set_model_state_dict(self._model, mine, options=StateDictOptions(full_state_dict=True))

    def _load_rank_state(self, path: Path, meta: dict[str, Any], names: tuple[str, ...]) -> None:
        @functools.cache
        def rank_file(rank: int) -> dict[str, Any]:  # the parts usually share one file
            return torch.load(path / f"rank_{rank}.pt", weights_only=True)

        error = None
        try:
            for part in self.rank_parts:
                source = part.source_rank(self, path, meta) if part.name in names else None
                if source is not None and (part.name in rank_file(source) or not part.optional):
                    part.put(self, rank_file(source)[part.name])
        except (CheckpointError, OSError, KeyError, RuntimeError, ValueError) as e:
            error = str(e) if isinstance(e, CheckpointError) else f"could not load per-rank state from {path}: {one_line(e)}"
        self._all_ok(error)
