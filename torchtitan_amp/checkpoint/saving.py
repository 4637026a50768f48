"""Saving and committing: a save writes `step-N.tmp/` (DCP parts, then each rank's file), at once
or in the background (DCP's async save, with the run's one pinned-memory stager, staging.py), and
the commit checksums the files, writes the marker and renames the folder to `step-N` (format.py),
then prunes (retention.py). Also the model-only and Hugging Face exports, and the save-time estimate.

`Saver` owns what outlives one save: the background save in flight, the pinned-memory stager, the
upload thread's process group, and when and how long the last commit was. What it saves is the
parts table's (parts.RunState); the ranks settle each step's outcome together (ranks.agree/all_ok).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from torchtitan_amp.checkpoint import replicas
from torchtitan_amp.checkpoint.format import (
    EXPORT_FILE,
    FORMAT_VERSION,
    MARKER,
    TORCH_DTYPES,
    dir_sizes,
    inspect_checkpoint,
    merge_export_parts,
    one_line,
    quiet_single_process,
)
from torchtitan_amp.checkpoint.integrity import file_crc32, verify_checksums
from torchtitan_amp.checkpoint.parts import RunState
from torchtitan_amp.checkpoint.ranks import RankLayout, agree, all_ok
from torchtitan_amp.checkpoint.retention import purge
from torchtitan_amp.checkpoint.staging import PinnedStager
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.config import JobConfig
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.distributed.process_groups import local_tensor as _local
from torchtitan_amp.models import get_family
from torchtitan_amp.precision.lora import base_dtypes

logger = logging.getLogger("torchtitan_amp")


@dataclass
class PendingSave:
    """A background save: its upload future and what committing it needs."""

    future: Future
    state: TrainState
    tmp: Path
    final: Path
    kind: str
    started: float


class Saver:
    """Writes and commits this run's checkpoints into `folder`. Every method that writes is
    collective: every rank calls it at the same point."""

    def __init__(
        self,
        config: JobConfig,
        folder: Path,
        ranks: RankLayout,
        state: RunState,
        *,
        enabled: bool,
        replica: replicas.ReplicaGroup | None = None,
    ) -> None:
        self.config = config
        self.replica = replica  # this run's replica group under fault tolerance (checkpoint/replicas.py)
        self.folder = folder
        self.ranks = ranks
        self.state = state
        self.enabled = enabled
        self.last_saved_step = -1
        # Seconds from asking for the last committed save to its commit (async: an upper bound,
        # the steps that overlapped the write are counted too).
        self.last_save_s = 0.0
        self.pending: PendingSave | None = None
        self.stager: PinnedStager | None = None  # async_with_pinned_mem's, one per run (pinned_stager)
        self.async_group = None
        if enabled and config.checkpoint.async_mode != "disabled" and dist.is_initialized():
            # The upload thread's collectives must not interleave with training's on the default group.
            self.async_group = dist.new_group(backend="gloo")

    def maybe_save(self, step: int, tokens_seen: int, *, last: bool = False, force: bool = False) -> None:
        """Save at every `interval` steps, at the last step, and when forced (preemption).

        Args:
            step: the step just finished.
            tokens_seen: tokens trained on so far, saved in the train state.
            last: whether it is the run's last step (saved whatever the interval, model-only when
                checkpoint.last_save_model_only, then exported when checkpoint.last_save_hf).
            force: save whatever the interval (a stop signal).
        """
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

        self.finish_pending()
        out = self.folder / f"hf-step-{step}"
        begin = time.monotonic()
        agree(self.ranks, lambda: export_hf(self.folder / f"step-{step}", out, self.config.checkpoint.export_dtype))
        if self.ranks.rank == 0:
            logger.info("step %d: Hugging Face export in %s (%.2f s)", step, out, time.monotonic() - begin)
        return out

    def save_seed(self) -> None:
        """Step 0, model only, DCP: any layout can start from it."""
        if (self.folder / "step-0").exists():
            raise CheckpointError(f"{self.folder / 'step-0'} already exists; remove it to create a new seed")
        self.save(0, 0, kind="seed")

    @torch.no_grad()
    def save(self, step: int, tokens_seen: int, *, kind: str = "full") -> None:
        """Save step `step` now: every rank writes into step-N.tmp, then the commit renames it (at once, or
        after the background upload under checkpoint.async_mode). Collective.

        Args:
            step: the step the checkpoint is of (its folder is step-<step>).
            tokens_seen: tokens trained on so far, saved in the train state.
            kind: "full" (every part), "model_only" (the model as one file) or "seed" (the model alone, DCP).
        """
        self.finish_pending()
        if self.replica is not None and kind != "seed" and not self._writes_shared(step, tokens_seen, kind):
            return
        begin = time.monotonic()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        agree(self.ranks, lambda: prepare_tmp(self.folder, tmp))
        state = TrainState(step, tokens_seen)
        if kind == "model_only":
            self._write_export(tmp)
            self.commit(state, tmp, final, kind, begin)
            return
        names = ("model",) if kind == "seed" else tuple(p.name for p in self.state.dcp_parts)
        sd = self.state.dcp_state(names, state)
        rank = self.ranks.rank
        error = None
        if kind == "full":
            try:
                torch.save(self.state.rank_state(), tmp / f"rank_{rank}.pt")
            except OSError as e:
                error = f"rank {rank} could not write {tmp}/rank_{rank}.pt: {one_line(e)}"
        all_ok(self.ranks, error)
        if self.config.checkpoint.async_mode == "disabled" or kind == "seed":
            with quiet_single_process():
                dcp.save(sd, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
            self.commit(state, tmp, final, kind, begin)
        else:
            self.pending = PendingSave(self._async_save(sd, tmp), state, tmp, final, kind, begin)
            self.last_saved_step = step
            if rank == 0:
                logger.info(
                    "step %d: checkpoint staged in %.2f s, writing in the background", step, time.monotonic() - begin
                )

    def _writes_shared(self, step: int, tokens_seen: int, kind: str) -> bool:
        """Under fault tolerance: this group's own files first (full saves), then whether this
        group also writes the step's shared checkpoint (replicas.py)."""
        assert self.replica is not None
        if kind == "full":
            self._save_own_files(step, tokens_seen)
        if self.replica.saves_shared():
            return True
        self.last_saved_step = step
        if self.ranks.rank == 0:
            logger.info(
                "step %d: replica group %d saved its own files; another group saves the shared checkpoint",
                step,
                self.replica.replica_id,
            )
        return False

    def _save_own_files(self, step: int, tokens_seen: int) -> None:
        """This group's per-rank files into ft-replica-<id>/step-N (and under DiLoCo its optimizer
        state, replicas.own_dcp_parts), committed with a marker."""
        assert self.replica is not None
        begin = time.monotonic()
        own = replicas.folder(self.folder, self.replica.replica_id)
        final, tmp = own / f"step-{step}", own / f"step-{step}.tmp"
        agree(self.ranks, lambda: prepare_tmp(own, tmp))
        rank, error = self.ranks.rank, None
        try:
            torch.save(self.state.rank_state(), tmp / f"rank_{rank}.pt")
        except OSError as e:
            error = f"rank {rank} could not write {tmp}/rank_{rank}.pt: {one_line(e)}"
        all_ok(self.ranks, error)
        own_parts = replicas.own_dcp_parts(self.state.outer_state is not None)
        if own_parts:
            with quiet_single_process():
                dcp.save(
                    self.state.dcp_state(own_parts, TrainState(step, tokens_seen)),
                    checkpoint_id=str(tmp),
                    no_dist=not dist.is_initialized(),
                )
        self.commit(TrainState(step, tokens_seen), tmp, final, replicas.KIND, begin)

    def _async_save(self, sd: dict[str, Any], tmp: Path) -> Future:
        kwargs: dict[str, Any] = {
            "checkpoint_id": str(tmp),
            "process_group": self.async_group,
            "no_dist": not dist.is_initialized(),
        }
        if self.config.checkpoint.async_mode == "async_with_pinned_mem":
            kwargs["async_stager"] = self.pinned_stager()
        with quiet_single_process():
            response = dcp.async_save(sd, **kwargs)
        if isinstance(response, Future):
            return response
        # An AsyncSaveResponse: the next optimizer step must not run before staging has copied
        # the tensors (on a GPU: the staging stream synchronized, staging.py), so wait for it
        # here; only the upload overlaps training.
        response.staging_completion.result()
        return response.upload_completion

    def pinned_stager(self) -> PinnedStager:
        """The run's one stager, made at the first save: its pinned host copies are reused by every
        save, and close() shuts it down. One per save would pin the whole state again and leak a
        thread each time. Reuse is safe: a save first finishes the previous one, whose upload
        reads those copies."""
        if self.stager is None:
            self.stager = PinnedStager()
        return self.stager

    def close_stager(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def uploading(self) -> bool:
        """Whether a background save's upload is still running on this rank."""
        return self.pending is not None and not self.pending.future.done()

    def finish_pending(self) -> None:
        """Wait for the background save in flight, if any, and commit it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        error = None
        try:
            pending.future.result()
        except Exception as e:
            error = f"background save of {pending.tmp} failed: {one_line(e)}"
        all_ok(self.ranks, error)
        self.commit(pending.state, pending.tmp, pending.final, pending.kind, pending.started)

    def close(self) -> None:
        """Finish any background save, then shut the pinned-memory stager down. Collective."""
        self.finish_pending()
        self.close_stager()

    def _write_export(self, tmp: Path) -> None:
        """The full model as one torch.save file in export_dtype. Every rank takes part.

        The first rank of each pipeline stage gathers its stages' tensors one at a time (so a
        rank holds at most one unsharded tensor on the device beyond its shards) and writes
        them; with several stages rank 0 then merges the parts into model.pt.
        """
        r = self.ranks
        dtype = TORCH_DTYPES[self.config.checkpoint.export_dtype]
        writer = r.rank % r.stage_ranks == 0
        part: dict[str, torch.Tensor] = {}
        for key, value in self.state.model_state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if writer:
                part[key] = (full.to(dtype) if full.is_floating_point() else full).cpu()
        name = EXPORT_FILE if r.pp_degree == 1 else f"model.stage{r.pp_rank}.pt"
        error = None
        if writer:
            try:
                torch.save(part, tmp / name)
            except OSError as e:
                error = f"could not write {tmp / name}: {one_line(e)}"
        all_ok(r, error)
        if r.pp_degree > 1:
            agree(
                r,
                lambda: merge_export_parts(tmp, r.pp_degree, self.state.model_args, get_family(self.config.model.name)),
            )

    def commit(self, state: TrainState, tmp: Path, final: Path, kind: str, begin: float) -> None:
        """Every rank has finished writing: rank 0 writes the marker and renames tmp -> final. Collective.

        Args:
            state: the train state saved (step and tokens seen, written into the marker).
            tmp: the written step-N.tmp folder.
            final: the step-N folder it becomes.
            kind: the checkpoint's kind, written into the marker ("full", "model_only", "seed", "replica").
            begin: time.monotonic() when the save was asked for, to log its duration.
        """
        r = self.ranks
        c = self.config.checkpoint
        crcs, error = self._checksum_share(tmp)
        gathered = all_ok(r, error, (r.rank, r.dp_rank, crcs))
        rank_dp = [(rank, d) for rank, d, _ in gathered]
        meta = {
            "format": FORMAT_VERSION,
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "kind": kind,
            "world_size": r.world_size,
            "dp_degree": r.dp_degree,
            "rank_dp": sorted(rank_dp),
            # The data position is samples consumed by the run (data/loader.py): any dp degree loads it.
            "data_order": "global",
            "model_args": dataclasses.asdict(self.state.model_args),
            "export_dtype": c.export_dtype if kind == "model_only" else None,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "job_config": self.config.to_dict(),
        }
        if self.state.adapters:  # LoRA: the model part holds the adapters; this is their base
            meta["lora_base"] = (
                self.config.checkpoint.initial_load_path or f"seed init (training.seed {self.config.training.seed})"
            )
            meta["lora_base_dtypes"] = base_dtypes(self.state.model)  # what the adapters trained against
        if self.replica is not None:
            meta["replica_group"] = self.replica.replica_id  # the group that wrote this folder
        if c.checksums:
            meta["crc32"] = {name: crc for *_, share in gathered for name, crc in sorted(share.items())}

        def publish_and_purge() -> None:  # rank 0; one broadcast hands every rank the outcome
            publish(final.parent, tmp, final, meta)
            logger.info("saved %s checkpoint %s in %.2f s", kind, final, time.monotonic() - begin)
            purge(final.parent, c.keep_latest_k, state.step, replicas.KIND if kind == replicas.KIND else "full")

        agree(r, publish_and_purge)
        self.last_saved_step = state.step
        self.last_save_s = time.monotonic() - begin

    def _checksum_share(self, tmp: Path) -> tuple[dict[str, str], str | None]:
        """CRC-32s of this rank's share of the files in tmp (ranks split them, so the cost is
        about one read of 1/world of the checkpoint per rank)."""
        if not self.config.checkpoint.checksums:
            return {}, None
        r = self.ranks
        names = agree(r, lambda: sorted(dir_sizes(tmp)))
        try:
            return {n: file_crc32(tmp / n) for n in names[r.rank :: r.world_size]}, None
        except OSError as e:
            return {}, f"rank {r.rank} could not checksum {tmp}: {one_line(e)}"

    def estimate_save_s(self, probe_bytes: int = 64 << 20) -> tuple[int, float]:
        """(bytes, seconds) of this rank's share of a full save, the slowest rank's time: the
        parameters plus AdamW's two moments (the optimizer state is created by the first step, so
        it is counted from the parameters) at the rate of a timed, fsynced write of up to
        `probe_bytes` into the checkpoint folder. Random bytes, so a compressing filesystem
        cannot flatter it. Collective."""
        size = 3 * sum(
            _local(p).numel() * _local(p).element_size() for part in self.state.model_parts for p in part.parameters()
        )
        n = max(min(size, probe_bytes), 1)
        path = self.folder / f".rate_probe_{self.ranks.rank}_{os.getpid()}"
        data = os.urandom(n)
        start = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        seconds = (time.perf_counter() - start) * size / n
        path.unlink()
        if dist.is_initialized() and self.ranks.world_size > 1:
            t = torch.tensor([seconds], dtype=torch.float64, device=self.state.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = float(t.item())
        return size, seconds


# ---------------------------------------------------------------------------------------------
# Rank 0's file operations


def probe_writable(folder: Path) -> None:
    """Rank 0 only: a run that cannot write its checkpoints says so before training, not at the
    first save."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint folder {folder} is not writable: {e.strerror or one_line(e)}") from None


def prepare_tmp(folder: Path, tmp: Path) -> None:
    """Rank 0 only."""
    # No save is in flight (pending async saves were finished), so any .tmp is a dead one.
    for stale in folder.glob("step-*.tmp"):
        logger.info("removing %s, left by a save that never finished", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def publish(folder: Path, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0 only: the marker into tmp, then tmp -> final (a complete checkpoint already there is
    replaced, a broken one kept aside as .corrupt), then the folder fsynced.

    Args:
        folder: the checkpoint folder holding both, fsynced last.
        tmp: the written step-N.tmp folder.
        final: the step-N folder it becomes.
        meta: the manifest to write as the marker (its file sizes are added here).
    """
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
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
