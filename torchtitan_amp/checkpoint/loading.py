"""Loading: which checkpoint to resume from (the newest complete one, `load_step`, else
`initial_load_path`; one that fails its checksums is skipped for the next older), then restoring
it, resharded to this run's layout: DCP parts by key, a model-only export or a Hugging Face folder
as starting weights, per-rank parts from the file of the rank that held this rank's share.

Free functions: restoring writes into the parts table's live objects (parts.RunState, which knows
this rank's place in the job); choosing needs only the config, the folder and the ranks.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from torchtitan_amp.checkpoint import replicas
from torchtitan_amp.checkpoint.format import (
    EXPORT_FILE,
    MARKER,
    describe_steps,
    inspect_checkpoint,
    one_line,
    quiet_single_process,
    scan_folder,
)
from torchtitan_amp.checkpoint.integrity import verify_checksums
from torchtitan_amp.checkpoint.parts import RunState
from torchtitan_amp.checkpoint.ranks import RankLayout, agree, all_ok
from torchtitan_amp.checkpoint.train_state import TrainState
from torchtitan_amp.config import JobConfig
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models import get_family
from torchtitan_amp.precision.lora import fp8_bases_loadable, is_split_nf4, load_nf4_whole

logger = logging.getLogger("torchtitan_amp")


class Choice(NamedTuple):
    """The checkpoint rank 0 picked to load (broadcast to every rank)."""

    path: str
    kind: str
    meta: dict[str, Any]
    initial: bool  # from checkpoint.initial_load_path: weights only, no fallback
    step: int


class Restored(NamedTuple):
    """What load() restored: the step and tokens to resume at, and the folder they came from."""

    train_state: TrainState
    path: Path


@torch.no_grad()
def load(
    config: JobConfig, folder: Path | None, state: RunState, replica: replicas.ReplicaGroup | None = None
) -> Restored | None:
    """Resume from the newest complete checkpoint in `folder` (or checkpoint.load_step), else from
    checkpoint.initial_load_path, into `state`. Collective. Returns the restored train state and the
    path it came from, or None when starting fresh.

    Args:
        config: the job config (its checkpoint section says what to load and what to leave out).
        folder: the run's checkpoint folder; None: checkpointing is off, only initial_load_path loads.
        state: the live objects the checkpoint's parts are loaded into.
        replica: this fault-tolerant replica group, which reads its per-rank parts from its own
            folder (replicas.py); None outside fault tolerance.
    """
    choice = choose_verified(config, folder, state.ranks, state.model_args)
    if choice is None:
        return None
    with fp8_bases_loadable(state.model_parts):  # an fp8 LoRA base: loaded whole, then re-quantized
        return _load_choice(config, folder, state, replica, choice)


def _load_choice(
    config: JobConfig, folder: Path | None, state: RunState, replica: replicas.ReplicaGroup | None, choice: Choice
) -> Restored:
    """`load` of the chosen checkpoint (its arguments, plus the choice)."""
    c = config.checkpoint
    ranks = state.ranks
    path, kind, initial = Path(choice.path), choice.kind, choice.initial
    if state.adapters and not initial and c.initial_load_path:
        # LoRA: a checkpoint holds the adapters; the frozen base comes from initial_load_path first.
        base = choose_initial(
            Path(c.initial_load_path), state.model_args, config.model.flavor, get_family(config.model.name)
        )
        _load_model(config, state, Path(base.path), base.kind, ("model",))
    begin = time.monotonic()
    every = tuple(p.name for p in state.parts)
    names = tuple(n for n in (("model",) if initial or kind != "full" else every) if n not in c.exclude_from_loading)
    if initial or kind in ("hf", "model_only"):
        train_state = _load_model(config, state, path, kind, names)
    else:
        train_state = load_dcp(state, path, names)
    if kind == "full":
        rank_path, rank_meta, rank_names = _rank_files(folder, replica, ranks, choice, names)
        load_rank_state(state, rank_path, rank_meta, rank_names)
        # Under DiLoCo a group's own files also hold its optimizer state (replicas.own_dcp_parts).
        own_parts = tuple(n for n in replicas.own_dcp_parts(state.outer_state is not None) if n in names)
        if own_parts and rank_path != Path(choice.path):
            load_dcp(state, rank_path, own_parts)
    if ranks.rank == 0:
        skipped = [n for n in every if n not in names]
        logger.info(
            "loaded %s (%s) in %.2f s: resuming at step %d%s",
            path,
            ", ".join(names),
            time.monotonic() - begin,
            train_state.step,
            f"; not loaded: {', '.join(skipped)}" if skipped and kind == "full" else "",
        )
    return Restored(train_state, path)


def choose_verified(config: JobConfig, folder: Path | None, ranks: RankLayout, model_args: Any) -> Choice | None:
    """Pick the checkpoint to load, with its files' CRC-32s checked: rank 0 picks one, every rank
    checks a share of its files; a corrupt one is named and the next older one is tried (unless it
    was asked for by name). Collective. Returns the choice, or None when starting fresh.

    Args:
        config: the job config (checkpoint.checksums, load_step, initial_load_path).
        folder: the run's checkpoint folder.
        ranks: where this rank sits in the job (rank and world size split the checksum work).
        model_args: this run's model arguments, which a Hugging Face initial_load_path must match.
    """
    corrupt: dict[int, str] = {}
    while True:
        choice = agree(ranks, lambda: choose(config, folder, model_args, corrupt))
        if choice is None or not config.checkpoint.checksums:
            return choice
        share = verify_checksums(choice.path, choice.meta, (ranks.rank, ranks.world_size))
        bad = next((b for b in all_ok(ranks, None, share) if b), None)
        if bad is None:
            return choice
        if choice.initial:
            raise CheckpointError(f"checkpoint.initial_load_path: {bad}")
        if ranks.rank == 0:
            logger.warning("checkpoint: skipping %s", bad)
        corrupt[choice.step] = bad


def choose(config: JobConfig, folder: Path | None, model_args: Any, corrupt: dict[int, str]) -> Choice | None:
    """The checkpoint rank 0 picks (every rank then loads the same one): the newest complete one in
    `folder`, or checkpoint.load_step, else checkpoint.initial_load_path; None when starting fresh.

    Args:
        config: the job config (checkpoint.load_step, initial_load_path).
        folder: the run's checkpoint folder; None: not read (checkpointing off), initial_load_path only.
        model_args: this run's model arguments, which a Hugging Face initial_load_path must match.
        corrupt: steps that failed their checksum, each with the reason (already logged): skipped,
            or an error when the step was asked for by name.
    """
    c = config.checkpoint
    if folder is None:
        if not c.initial_load_path:
            return None
        return choose_initial(Path(c.initial_load_path), model_args, config.model.flavor, get_family(config.model.name))
    complete, problems = scan_folder(folder)
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
                f"{folder}{why}; available steps: {describe_steps(complete)}"
            )
        if info.kind == "model_only":
            raise CheckpointError(
                f"checkpoint.load_step = {c.load_step}: {info.path} is a model-only export, not a resume "
                f"point; use checkpoint.initial_load_path = '{info.path}' to start from its weights"
            )
        return Choice(str(info.path), info.kind, info.meta, False, info.step)
    resumable = {s: i for s, i in complete.items() if i.kind != "model_only"}
    if resumable:
        info = resumable[max(resumable)]
        newer = [s for s in complete if s > info.step]
        if newer:
            logger.info("checkpoint: step-%s is a model-only export, not a resume point", newer[0])
        if problems:
            logger.warning("checkpoint: resuming from the newest complete checkpoint, %s", info.path)
        return Choice(str(info.path), info.kind, info.meta, False, info.step)
    if c.initial_load_path:
        return choose_initial(Path(c.initial_load_path), model_args, config.model.flavor, get_family(config.model.name))
    if problems:
        logger.warning("checkpoint: no complete checkpoint in %s; starting from scratch", folder)
    return None


def choose_initial(path: Path, model_args: Any, flavor: str, family: Any = None) -> Choice:
    """Resolve checkpoint.initial_load_path: one of ours, a Hugging Face folder, a foreign DCP checkpoint,
    or a checkpoint folder (its newest complete one). Raises CheckpointError when it is none of them.

    Args:
        path: the initial_load_path.
        model_args: this run's model arguments, which a Hugging Face folder's config.json must match.
        flavor: this run's model.flavor, named when a Hugging Face config.json differs.
        family: the model family reading a Hugging Face config; None takes the family of `model_args`.
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
    if (path / MARKER).is_file():
        info = inspect_checkpoint(path)
        return Choice(str(path), info.kind, info.meta, True, info.step)
    if (path / "config.json").is_file():  # a Hugging Face model folder
        from torchtitan_amp.checkpoint.hf import check_config

        check_config(path, model_args, flavor, family)
        return Choice(str(path), "hf", {}, True, 0)
    if (path / ".metadata").is_file():  # a DCP checkpoint written by another tool
        return Choice(str(path), "seed", {}, True, 0)
    complete, problems = scan_folder(path)
    for line in problems:
        logger.warning("checkpoint: %s", line)
    if not complete:
        raise CheckpointError(f"checkpoint.initial_load_path {path} holds no complete checkpoint")
    info = complete[max(complete)]
    return Choice(str(info.path), info.kind, info.meta, True, info.step)


def _load_model(config: JobConfig, state: RunState, path: Path, kind: str, names: tuple[str, ...]) -> TrainState:
    """Starting weights (an initial_load_path): an HF folder, a model-only export or a DCP step
    folder. Under LoRA they are the base's: the adapters keep their init."""
    ranks = state.ranks
    if kind == "hf":
        from torchtitan_amp.checkpoint.hf import load_hf  # needs safetensors, only for HF folders

        load_hf(
            state.model,
            path,
            state.model_args,
            complete_model=ranks.pp_degree == 1,
            agree=lambda error: all_ok(ranks, error),
            family=get_family(config.model.name),
        )
        return TrainState()
    if kind == "model_only":
        load_export(state, path)
        return TrainState()
    state.model_keys = "base"
    try:
        return load_dcp(state, path, names)
    finally:
        state.model_keys = "adapters"


def load_dcp(state: RunState, path: Path, names: tuple[str, ...]) -> TrainState:
    """Load the DCP parts among `names` into `state`; returns the saved TrainState, or a fresh one when
    the train state is not among them. Collective; a part that does not fit fails every rank alike.

    Args:
        state: the live objects the parts are loaded into.
        path: the checkpoint's step folder (DCP files and .metadata).
        names: the parts to load (names of the PARTS table).
    """
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = state.dcp_state(names, TrainState())
    error = None
    try:
        for part in state.dcp_parts:
            if part.name in sd and not part.loadable(state, path, saved, sd[part.name]):
                sd.pop(part.name)
    except CheckpointError as e:
        error = str(e)
    all_ok(state.ranks, error)
    # QLoRA on FSDP: the NF4 bases are read whole afterwards (load_nf4_whole), not row by row.
    split_nf4 = {k: sd["model"].pop(k) for k in list(sd.get("model", {})) if is_split_nf4(sd["model"][k])}
    try:
        with quiet_single_process():
            dcp.load(sd, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:
        raise CheckpointError(f"could not load {path}: {one_line(e)}") from None
    state.train_state = TrainState()
    for part in state.dcp_parts:
        if part.name in sd:
            part.put(state, sd[part.name])
    load_nf4_whole(split_nf4, lambda whole: _dcp_read(path, whole))
    return state.train_state


def _dcp_read(path: Path, whole: dict[str, torch.Tensor]) -> None:
    """Full tensors of the checkpoint's "model" part into `whole` (its keys), on every rank."""
    try:
        with quiet_single_process():
            dcp.load({"model": whole}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:
        raise CheckpointError(f"could not load {path}: {one_line(e)}") from None


def load_export(state: RunState, path: Path) -> None:
    """A model-only export (full tensors, maybe another dtype) as starting weights."""
    sd = torch.load(path / EXPORT_FILE, map_location="cpu", weights_only=True, mmap=True)
    error = None
    try:
        own = {k: v for k, v in state.model_state_dict().items() if k not in state.adapters}
        for key, value in own.items():
            if key not in sd or tuple(sd[key].shape) != tuple(value.shape):
                got = tuple(sd[key].shape) if key in sd else "nothing"
                raise CheckpointError(
                    f"{path} does not fit this model: '{key}' has shape {got} in the "
                    f"export but {tuple(value.shape)} in the model"
                )
        # A whole model takes every tensor (an untied export's output.weight has no place in a tied one).
        extra = sorted(set(sd) - set(own)) if state.ranks.pp_degree == 1 else []
        if extra:
            raise CheckpointError(f"{path} does not fit this model: the model has no '{extra[0]}'")
    except CheckpointError as e:
        error = str(e)
    all_ok(state.ranks, error)
    split_nf4 = {k: v for k, v in own.items() if is_split_nf4(v)}
    mine = {k: v for k, v in sd.items() if k in own and k not in split_nf4}
    set_model_state_dict(state.model, mine, options=StateDictOptions(full_state_dict=True, strict=not state.adapters))
    load_nf4_whole(split_nf4, lambda whole: whole.update({k: sd[k] for k in whole}))


def _rank_files(
    folder: Path | None,
    replica: replicas.ReplicaGroup | None,
    ranks: RankLayout,
    choice: Choice,
    names: tuple[str, ...],
) -> tuple[Path, dict[str, Any], tuple[str, ...]]:
    """Where the per-rank parts come from: the chosen checkpoint, or a replica group's own files of
    its step. A group without them takes the (global) positions from the shared checkpoint and
    keeps its seeded RNG states: the saving group's would be another group's."""
    if replica is None or choice.initial or folder is None:
        return Path(choice.path), choice.meta, names
    own = agree(ranks, lambda: replicas.own_files(folder, replica, choice.step, ranks.world_size))
    if own is not None:
        return own[0], own[1], names
    return Path(choice.path), choice.meta, tuple(n for n in names if n != "rng")


def load_rank_state(state: RunState, path: Path, meta: dict[str, Any], names: tuple[str, ...]) -> None:
    """Load the per-rank parts among `names` into `state`, each from the rank_<r>.pt file its
    `source_rank` names.

    Args:
        state: the live objects the parts are loaded into.
        path: the folder holding the rank files.
        meta: that checkpoint's manifest (the layout it was saved with, which picks the source rank).
        names: the parts to load (names of the PARTS table).
    """

    @functools.cache
    def rank_file(rank: int) -> dict[str, Any]:  # the parts usually share one file
        return torch.load(path / f"rank_{rank}.pt", weights_only=True)

    error = None
    try:
        for part in state.rank_parts:
            source = part.source_rank(state, path, meta) if part.name in names else None
            if source is not None and (part.name in rank_file(source) or not part.optional):
                part.put(state, rank_file(source)[part.name])
    except (CheckpointError, OSError, KeyError, RuntimeError, ValueError) as e:
        error = (
            str(e) if isinstance(e, CheckpointError) else f"could not load per-rank state from {path}: {one_line(e)}"
        )
    all_ok(state.ranks, error)
