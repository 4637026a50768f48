"""The on-disk format of a checkpoint folder: names, the completion marker and manifest, what
makes a `step-N` folder complete, and the single-file model export. No process group needed.

A full checkpoint `<job.dump_folder>/<checkpoint.folder>/step-N/` holds DCP files (one
`__<rank>_0.distcp` per rank plus `.metadata`), one `rank_<r>.pt` per global rank, and
`checkpoint.json`, written last: the completion marker and manifest (every file and its size and
CRC-32, step, kind, world size, dp degree, model args, the job config).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.core.rules import DTYPES

FORMAT_VERSION = 1
MARKER = "checkpoint.json"
EXPORT_FILE = "model.pt"
# Kinds of complete checkpoint: full (a resume point), seed (step 0, DCP model only),
# model_only (the last step's single-file export; not a resume point), replica (a fault-tolerant
# replica group's own per-rank files, no DCP: checkpoint/replicas.py).
KINDS = ("full", "seed", "model_only", "replica")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # export dtypes
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save or load that it assumes one process: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    kind: str
    meta: dict[str, Any]


def dir_sizes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Validate one complete checkpoint folder; CheckpointError says what is wrong with it."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} has no {MARKER} completion marker (the save never finished)")
    try:
        meta = json.loads(marker.read_text())
        step, kind, files = int(meta["step"]), meta["kind"], meta["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/{MARKER} is unreadable ({one_line(e)})") from None
    if meta.get("format") != FORMAT_VERSION or kind not in KINDS:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r} / kind {kind!r}")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{path}: file {name} has {f.stat().st_size} bytes, the manifest says {size} (truncated or corrupt)"
            )
    if kind not in ("model_only", "replica"):
        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:
            raise CheckpointError(f"{path}: DCP .metadata is unreadable ({one_line(e)})") from None
    return CheckpointInfo(path, step, kind, meta)


def scan_folder(folder: str | Path) -> tuple[dict[int, CheckpointInfo], list[str]]:
    """Complete checkpoints by step, and one line for every folder entry that is not one."""
    folder = Path(folder)
    complete: dict[int, CheckpointInfo] = {}
    problems: list[str] = []
    if not folder.is_dir():
        return complete, problems
    for entry in sorted(folder.iterdir()):
        if _TMP_DIR.match(entry.name):
            problems.append(f"ignoring {entry}: an unfinished save")
        elif (step_dir := _STEP_DIR.match(entry.name)) and entry.is_dir():
            try:
                info = inspect_checkpoint(entry)
            except CheckpointError as e:
                problems.append(f"skipping {e}")
                continue
            if info.step != int(step_dir.group(1)):
                problems.append(f"skipping {entry}: its marker says step {info.step}")
                continue
            complete[info.step] = info
    return complete, problems


def describe_steps(complete: dict[int, CheckpointInfo]) -> str:
    if not complete:
        return "none"
    return ", ".join(f"{s}" + ("" if i.kind == "full" else f" ({i.kind})") for s, i in sorted(complete.items()))


def check_model_fits(
    path: Path, saved_metadata: dict[str, Any], model_sd: dict[str, Any], prefix: str, complete_model: bool
) -> None:
    """Raise a CheckpointError naming the first key whose presence or global shape differs between a
    checkpoint and the model; return None when the model fits.

    Args:
        path: the checkpoint folder, named in the error.
        saved_metadata: the checkpoint's DCP state_dict_metadata (key -> tensor metadata).
        model_sd: the model's state dict (this rank's part; global shapes for DTensors).
        prefix: the prefix of the model's keys in the checkpoint ("model." in a full checkpoint, ""
            in a model-only one); keys without it are not compared.
        complete_model: whether `model_sd` is the whole model; then a checkpoint key the model lacks
            is refused too (a pipeline stage holds only part of the keys, so it passes False).
    """
    saved = {k[len(prefix) :]: v for k, v in saved_metadata.items() if k.startswith(prefix)}
    for key, value in model_sd.items():
        if key not in saved:
            raise CheckpointError(f"{path} does not fit this model: it has no '{key}'")
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != tuple(value.shape):
            raise CheckpointError(
                f"{path} does not fit this model: '{key}' has shape {saved_shape} in the checkpoint "
                f"but {tuple(value.shape)} in the model (different model flavor or vocab?)"
            )
    extra = sorted(set(saved) - set(model_sd))
    if complete_model and extra:
        raise CheckpointError(f"{path} does not fit this model: the model has no '{extra[0]}'")


def _cast_floats(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def export_checkpoint(step_dir: str | Path, output: str | Path, dtype: str = "float32") -> Path:
    """Write a checkpoint's model as one torch.save file of a plain state dict (single process).

    The result loads with `family.build_model(family.args_from_dict(meta['model_args']))
    .load_state_dict`, the family being meta's job_config model.name. Returns the path written.

    Args:
        step_dir: the checkpoint's step folder (a full DCP checkpoint or a model-only export).
        output: the file to write; its parent folders are created.
        dtype: the dtype name floating-point tensors are cast to (a key of TORCH_DTYPES, e.g.
            "float32", "bfloat16"); integer tensors keep theirs.
    """
    info = inspect_checkpoint(step_dir)
    if info.kind == "model_only":
        sd = torch.load(info.path / EXPORT_FILE, weights_only=True)
    else:
        family = checkpoint_family(info.meta)
        with torch.device("meta"):
            model = family.build_model(family.args_from_dict(info.meta["model_args"]))
        model.to_empty(device="cpu")
        sd = model.state_dict()
        with quiet_single_process():
            dcp.load({"model": sd}, checkpoint_id=str(info.path), no_dist=True)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_cast_floats(sd, TORCH_DTYPES[dtype]), output)
    return output


def merge_parts(parts: list[nn.Module]) -> nn.Module:
    """One module over several pipeline stages of this rank, with the stages' own FQNs.

    The state_dict helpers take one model; stage FQNs never collide (layers are a ModuleDict
    keyed by global layer index), so merging the top-level children keeps every name.
    """
    merged = nn.Module()
    for part in parts:
        for name, child in part.named_children():
            present = merged._modules.get(name)
            if isinstance(child, nn.ModuleDict) and isinstance(present, nn.ModuleDict):
                present.update(dict(child.items()))
            elif isinstance(child, nn.ModuleDict):
                merged.add_module(name, nn.ModuleDict(dict(child.items())))
            elif child is not None:
                merged.add_module(name, child)
    return merged


def checkpoint_family(meta: dict[str, Any]) -> Any:
    """The model family a checkpoint was saved from (its job config's model.name; "llama3" for
    checkpoints written before the field could differ)."""
    from torchtitan_amp.models import get_family

    return get_family(meta.get("job_config", {}).get("model", {}).get("name", "llama3"))


def merge_export_parts(tmp: Path, pp_degree: int, model_args: Any, family: Any) -> None:
    """Merge model.stage<p>.pt of every pipeline stage into one model.pt in the plain model's key order.

    Raises CheckpointError when the stages' keys are not exactly the plain model's.

    Args:
        tmp: the folder holding the stage files; model.pt is written there and the stage files removed.
        pp_degree: the number of pipeline stages, so of stage files.
        model_args: the model's arguments, to build the plain model on the meta device for its keys.
        family: the model family (models.FAMILIES) that builds it.
    """
    merged: dict[str, torch.Tensor] = {}
    parts = [tmp / f"model.stage{p}.pt" for p in range(pp_degree)]
    for part in parts:
        merged.update(torch.load(part, map_location="cpu", weights_only=True, mmap=True))
    with torch.device("meta"):
        order = list(family.build_model(model_args).state_dict())
    missing = [k for k in order if k not in merged]
    if missing or len(merged) != len(order):
        raise CheckpointError(
            f"pipeline stages exported {len(merged)} tensors, the model has {len(order)}"
            + (f" (missing '{missing[0]}')" if missing else "")
        )
    torch.save({k: merged[k] for k in order}, tmp / EXPORT_FILE)
    for part in parts:
        part.unlink()
