"""Saving and committing: a save writes `step-N.tmp/` (DCP parts, then each rank's file), at once
or in the background (DCP's async save, with the run's one pinned-memory stager), and the commit
checksums the files, writes the marker and renames the folder to `step-N` (format.py), then prunes
(retention.py). Also the model-only and Hugging Face exports, and the save-time estimate.

Free functions over the manager `m` (the state they save lives there, and its collective helpers).
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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

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
from torchtitan_amp.checkpoint.retention import purge
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.core.torch_compat import default_stager_reusable
from torchtitan_amp.distributed.process_groups import local_tensor as _local
from torchtitan_amp.models import get_family

if TYPE_CHECKING:
    from torchtitan_amp.checkpoint.manager import CheckpointManager

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


def maybe_save(m: CheckpointManager, step: int, tokens_seen: int, *, last: bool, force: bool) -> None:
    """Save at every `interval` steps, at the last step, and when forced (preemption)."""
    if not m.enabled or step == m.last_saved_step:
        return
    if not (force or last or step % m.config.checkpoint.interval == 0):
        return
    kind = "model_only" if last and m.config.checkpoint.last_save_model_only else "full"
    m.save(step, tokens_seen, kind=kind)
    if last and m.config.checkpoint.last_save_hf:
        m.export_hf(step)


def export_hf(m: CheckpointManager, step: int) -> Path:
    """Convert the committed step-N into a Hugging Face folder hf-step-N beside it. Rank 0
    converts (one shard at a time, from the files: no rank holds the model twice); the others
    wait for its outcome."""
    from torchtitan_amp.checkpoint.hf import export_hf  # needs safetensors, only when asked

    finish_pending(m)
    out = m.folder / f"hf-step-{step}"
    begin = time.monotonic()
    m._agree(lambda: export_hf(m.folder / f"step-{step}", out, m.config.checkpoint.export_dtype))
    if m.rank == 0:
        logger.info("step %d: Hugging Face export in %s (%.2f s)", step, out, time.monotonic() - begin)
    return out


def save_seed(m: CheckpointManager) -> None:
    """Step 0, model only, DCP: any layout can start from it."""
    if (m.folder / "step-0").exists():
        raise CheckpointError(f"{m.folder / 'step-0'} already exists; remove it to create a new seed")
    m.save(0, 0, kind="seed")


@torch.no_grad()
def save(m: CheckpointManager, step: int, tokens_seen: int, *, kind: str) -> None:
    # Commits go through m._commit, not commit(): tests replace the method to crash mid-commit.
    finish_pending(m)
    begin = time.monotonic()
    final = m.folder / f"step-{step}"
    tmp = m.folder / f"step-{step}.tmp"
    m._agree(lambda: prepare_tmp(m.folder, tmp))
    state = TrainState(step, tokens_seen)
    if kind == "model_only":
        write_export(m, tmp)
        m._commit(state, tmp, final, kind, begin)
        return
    names = ("model",) if kind == "seed" else tuple(p.name for p in m.dcp_parts)
    sd = m._dcp_state(names, state)
    error = None
    if kind == "full":
        try:
            torch.save(m._rank_state(), tmp / f"rank_{m.rank}.pt")
        except OSError as e:
            error = f"rank {m.rank} could not write {tmp}/rank_{m.rank}.pt: {one_line(e)}"
    m._all_ok(error)
    if m.config.checkpoint.async_mode == "disabled" or kind == "seed":
        with quiet_single_process():
            dcp.save(sd, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        m._commit(state, tmp, final, kind, begin)
    else:
        m._pending = PendingSave(async_save(m, sd, tmp), state, tmp, final, kind, begin)
        m.last_saved_step = step
        if m.rank == 0:
            logger.info("step %d: checkpoint staged in %.2f s, writing in the background", step,
                        time.monotonic() - begin)


def async_save(m: CheckpointManager, sd: dict[str, Any], tmp: Path) -> Future:
    kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "process_group": m._async_pg,
                              "no_dist": not dist.is_initialized()}
    if m.config.checkpoint.async_mode == "async_with_pinned_mem":
        kwargs["async_stager"] = pinned_stager(m)
    with quiet_single_process():
        response = dcp.async_save(sd, **kwargs)
    if isinstance(response, Future):
        return response
    # An AsyncSaveResponse: the next optimizer step must not run before staging has copied
    # the tensors, so wait for it here; only the upload overlaps training.
    response.staging_completion.result()
    return response.upload_completion


def pinned_stager(m: CheckpointManager) -> Any:
    """The run's one stager, made at the first save: its pinned host copies are reused by every
    save, and close() shuts it down. One per save would pin the whole state again and leak a
    thread each time. Reuse is safe: a save first finishes the previous one, whose upload
    reads those copies. Where torch's stager serves one save only (torch_compat, 2.11), it is
    closed once its save is committed and the next save makes another."""
    if m._stager is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        m._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                 use_async_staging=True, use_non_blocking_copy=True))
    return m._stager


def close_stager(m: CheckpointManager) -> None:
    if m._stager is not None:
        m._stager.close()
        m._stager = None


def finish_pending(m: CheckpointManager) -> None:
    """Wait for the background save in flight, if any, and commit it."""
    pending, m._pending = m._pending, None
    if pending is None:
        return
    error = None
    try:
        pending.future.result()
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = f"background save of {pending.tmp} failed: {one_line(e)}"
    if m._stager is not None and not default_stager_reusable():
        close_stager(m)
    m._all_ok(error)
    m._commit(pending.state, pending.tmp, pending.final, pending.kind, pending.started)


def write_export(m: CheckpointManager, tmp: Path) -> None:
    """The full model as one torch.save file in export_dtype. Every rank takes part.

    The first rank of each pipeline stage gathers its stages' tensors one at a time (so a
    rank holds at most one unsharded tensor on the device beyond its shards) and writes
    them; with several stages rank 0 then merges the parts into model.pt.
    """
    dtype = TORCH_DTYPES[m.config.checkpoint.export_dtype]
    writer = m.rank % m.stage_ranks == 0
    part: dict[str, torch.Tensor] = {}
    for key, value in m._model_state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if writer:
            part[key] = (full.to(dtype) if full.is_floating_point() else full).cpu()
    name = EXPORT_FILE if m.pp_degree == 1 else f"model.stage{m.pp_rank}.pt"
    error = None
    if writer:
        try:
            torch.save(part, tmp / name)
        except OSError as e:
            error = f"could not write {tmp / name}: {one_line(e)}"
    m._all_ok(error)
    if m.pp_degree > 1:
        m._agree(lambda: merge_export_parts(tmp, m.pp_degree, m.model_args,
                                                get_family(m.config.model.name)))


def prepare_tmp(folder: Path, tmp: Path) -> None:
    """Rank 0 only."""
    # No save is in flight (pending async saves were finished), so any .tmp is a dead one.
    for stale in folder.glob("step-*.tmp"):
        logger.info("removing %s, left by a save that never finished", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def commit(m: CheckpointManager, state: TrainState, tmp: Path, final: Path, kind: str, begin: float) -> None:
    """Every rank has finished writing: rank 0 writes the marker and renames tmp -> final."""
    crcs, error = checksum_share(m, tmp)
    gathered = m._all_ok(error, (m.rank, m.dp_rank, crcs))
    rank_dp = [(r, d) for r, d, _ in gathered]
    meta = {
        "format": FORMAT_VERSION, "step": state.step, "tokens_seen": state.tokens_seen, "kind": kind,
        "world_size": m.world_size,
        "dp_degree": m.dp_degree, "rank_dp": sorted(rank_dp),
        # The data position is samples consumed by the run (data/loader.py): any dp degree loads it.
        "data_order": "global",
        "model_args": dataclasses.asdict(m.model_args),
        "export_dtype": m.config.checkpoint.export_dtype if kind == "model_only" else None,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
        "job_config": m.config.to_dict(),
    }
    if m.config.checkpoint.checksums:
        meta["crc32"] = {name: crc for *_, share in gathered for name, crc in sorted(share.items())}

    def publish_and_purge() -> None:  # rank 0; one broadcast hands every rank the outcome
        publish(m.folder, tmp, final, meta)
        logger.info("saved %s checkpoint %s in %.2f s", kind, final, time.monotonic() - begin)
        purge(m.folder, m.config.checkpoint.keep_latest_k, state.step)

    m._agree(publish_and_purge)
    m.last_saved_step = state.step
    m.last_save_s = time.monotonic() - begin


def checksum_share(m: CheckpointManager, tmp: Path) -> tuple[dict[str, str], str | None]:
    """CRC-32s of this rank's share of the files in tmp (ranks split them, so the cost is
    about one read of 1/world of the checkpoint per rank)."""
    if not m.config.checkpoint.checksums:
        return {}, None
    names = m._agree(lambda: sorted(dir_sizes(tmp)))
    try:
        return {n: file_crc32(tmp / n) for n in names[m.rank::m.world_size]}, None
    except OSError as e:
        return {}, f"rank {m.rank} could not checksum {tmp}: {one_line(e)}"


def publish(folder: Path, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0 only: the marker into tmp, then tmp -> final (a complete checkpoint already there is
    replaced, a broken one kept aside as .corrupt), then the folder fsynced."""
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


def estimate_save_s(m: CheckpointManager, probe_bytes: int) -> tuple[int, float]:
    """(bytes, seconds) of this rank's share of a full save, the slowest rank's time: the
    parameters plus AdamW's two moments (the optimizer state is created by the first step, so
    it is counted from the parameters) at the rate of a timed, fsynced write of up to
    `probe_bytes` into the checkpoint folder. Random bytes, so a compressing filesystem
    cannot flatter it. Collective."""
    size = 3 * sum(_local(p).numel() * _local(p).element_size()
                   for part in m.model_parts for p in part.parameters())
    n = max(min(size, probe_bytes), 1)
    path = m.folder / f".rate_probe_{m.rank}_{os.getpid()}"
    data = os.urandom(n)
    start = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = (time.perf_counter() - start) * size / n
    path.unlink()
    if dist.is_initialized() and m.world_size > 1:
        t = torch.tensor([seconds], dtype=torch.float64, device=m.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t.item())
    return size, seconds
