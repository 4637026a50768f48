"""Hugging Face folders in both directions, for every model family: import as starting weights on
any parallel layout, export any checkpoint as safetensors shards + index + config.json (+ tokenizer
files). The family's `HFAdapter` (models/<family>/hf.py) says the names, which tensors' rows the
rotary layouts order differently, and config.json's fields; this module does the rest.

Import goes through DCP with torch's own `HuggingFaceStorageReader`, taught our names and our
rotary layout (`HFReader`): DCP plans which slice of which tensor each rank needs (FSDP, TP,
PP and their compositions alike) and every rank reads only its slices from the memory-mapped
shards, so no rank ever holds the full model. Export runs in one process and converts one output
shard at a time (`export_hf`), so it never holds the model twice.

Two rotary layouts differ: our models rotate interleaved pairs (x[2i], x[2i+1]) (Meta's layout),
Hugging Face's rotate halves (x[i], x[i + head_dim/2]). The rows of the tensors the adapter names
(Llama: the q and k projections) are permuted within each head on the way in and out.

Names map one to one, except where the adapter says otherwise: a tensor of ours that HF stores as
several (MoE experts: one [E, ...] weight of ours, E per-expert nn.Linear weights there) is read
part by part and stacked (each part transposed where the adapter says so), and written back as
its parts; a tensor HF has no place for (MoE expert bias) is zeroed on import and must be zero to
export.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from torchtitan_amp.checkpoint.format import (
    EXPORT_FILE,
    TORCH_DTYPES,
    check_model_fits,
    checkpoint_family,
    inspect_checkpoint,
    one_line,
    quiet_single_process,
)
from torchtitan_amp.checkpoint.hf_sources import DerivedSources
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models import FAMILIES, ModelFamily
from torchtitan_amp.models.spec import HFAdapter
from torchtitan_amp.precision.lora import adapter_parameters, is_nf4, nf4_rows

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default for save_pretrained


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved pairs -> halves: row 2i + c of each head goes to row c * head_dim/2 + i."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Halves -> interleaved pairs (the inverse of permute_to_hf)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# config.json <-> model args


def read_config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / CONFIG} is unreadable ({one_line(e)})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{folder / CONFIG} is not a JSON object")
    return cfg


def check_config(folder: Path, args: Any, flavor: str = "", family: ModelFamily | None = None) -> dict[str, Any]:
    """Check that a Hugging Face folder's config.json describes exactly this run's model; raise a
    CheckpointError naming the first differing field in one line. Returns the config.

    Args:
        folder: the Hugging Face folder.
        args: this run's model arguments.
        flavor: the run's model.flavor, named in the error as where a differing field came from.
        family: the model family whose adapter reads the config; None takes the family of `args`.
    """
    cfg = read_config(folder)
    hf = _adapter(family_of(args, family))
    theirs, ours = hf.config_fields(cfg, folder), hf.args_fields(args)
    for key, value in ours.items():
        got = theirs.get(key)
        same = math.isclose(got, value, rel_tol=1e-9) if isinstance(value, float) and got is not None else got == value
        if not same:
            source = "the tokenizer (model.tokenizer)" if key == "vocab_size" else f"model.flavor {flavor!r}"
            shown = hf.describe(key, got)
            raise CheckpointError(
                f"{folder / CONFIG}: '{hf.field_names[key]}' = {shown} but {source} has {key} = {value}"
            )
    return cfg


def family_of(args: Any, family: ModelFamily | None = None) -> ModelFamily:
    """`family`, or the registered one whose args class `args` is (callers that know model.name
    pass its family; the args type answers for the rest)."""
    if family is not None:
        return family
    found = [f for f in FAMILIES.values() if type(args) is f.args_cls]
    if not found:
        raise CheckpointError(f"no registered model family has args of type {type(args).__name__}")
    return found[0]


def _adapter(family: ModelFamily) -> HFAdapter:
    if family.hf is None:
        raise CheckpointError(f"model family {family.name!r} has no Hugging Face adapter")
    return family.hf


def hf_config(
    args: Any, dtype: str, bos_id: int | None, eos_id: int | None, family: ModelFamily | None = None
) -> dict[str, Any]:
    """The config.json for `args`, as its family writes it.

    Args:
        args: the model arguments to describe.
        dtype: the torch_dtype the folder's weights are stored in ("bfloat16", "float32", ...).
        bos_id: the tokenizer's beginning-of-sequence id, or None when it has none.
        eos_id: the tokenizer's end-of-sequence id, or None when it has none.
        family: the model family whose adapter writes it; None takes the family of `args`.
    """
    return _adapter(family_of(args, family)).hf_config(args, dtype, bos_id, eos_id)


# ---------------------------------------------------------------------------------------------
# Import


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files to read: those the index names (each must exist), else every one."""
    index = folder / INDEX
    if not index.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} has a {CONFIG} but no *.safetensors weights")
        return files
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is unreadable ({one_line(e)})") from None
    for name in names:
        if not (folder / name).is_file():
            raise CheckpointError(f"{index} names {name}, which is missing from {folder}")
    return [folder / n for n in names]


class HFReader(HuggingFaceStorageReader):
    """A Hugging Face folder as DCP sees it: tensors under our FQNs, q/k rows in our
    rotary layout, and `output.weight` read from the embeddings when config.json ties them.

    DCP asks for slices ([offset, offset + length) per dim) of global tensors; a q/k slice is
    read as the whole heads it touches, permuted, then cut, so a rank reads at most two heads
    beyond its shard."""

    def __init__(self, folder: Path, args: Any, tied: bool, adapter: HFAdapter) -> None:
        super().__init__(str(folder))
        self.folder, self.args, self.tied, self.adapter = folder, args, tied, adapter
        self.hf_name: dict[str, str] = {}  # our FQN -> HF tensor name
        # our FQN of a stacked tensor -> its parts' (file, HF name) in stacking order, and whether
        # each part is transposed
        self.parts: dict[str, tuple[list[tuple[str, str]], bool]] = {}
        self.derived = DerivedSources(folder, adapter.derived(args))  # tensors computed from whole HF ones

    def read_metadata(self) -> Metadata:
        from safetensors import SafetensorError, safe_open

        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _HFStorageInfo] = {}
        found: dict[str, dict[str, tuple[Path, torch.Size, torch.dtype]]] = {}  # stacked FQN -> its parts seen
        for path in _shard_files(self.folder):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        if self.derived.wants(name):
                            piece = f.get_slice(name)
                            self.derived.take(name, path, piece.get_shape(), _dtype(piece.get_dtype(), path, name))
                            continue
                        ours = self.adapter.from_hf_name(name)
                        if ours is None and self.adapter.ignored.search(name):
                            continue
                        if ours is None:
                            raise CheckpointError(
                                f"{path}: tensor '{name}' is not part of a {self.adapter.display_name} model"
                            )
                        piece = f.get_slice(name)
                        shape, dtype = torch.Size(piece.get_shape()), _dtype(piece.get_dtype(), path, name)
                        if self.adapter.stacked(ours, self.args) is not None:
                            found.setdefault(ours, {})[name] = (path, shape, dtype)
                            continue
                        self.hf_name[ours] = name
                        tensors[ours] = TensorStorageMetadata(
                            TensorProperties(dtype=dtype),
                            shape,
                            [ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)],
                        )
                        storage[MetadataIndex(ours, [0] * len(shape))] = _HFStorageInfo(str(path), shape, dtype)
            except SafetensorError as e:
                raise CheckpointError(f"{path} is not a readable safetensors file ({one_line(e)})") from None
        stacked = [(ours, *self._stack(ours, parts)) for ours, parts in found.items()]
        derived = [(ours, *got) for ours, got in self.derived.resolve().items()]
        for ours, shape, dtype, first in stacked + derived:
            tensors[ours] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), shape, [ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)]
            )
            storage[MetadataIndex(ours, [0] * len(shape))] = _HFStorageInfo(first, shape, dtype)
        if self.tied and "output.weight" not in tensors and "tok_embeddings.weight" in tensors:
            tensors["output.weight"] = tensors["tok_embeddings.weight"]
            self.hf_name["output.weight"] = self.hf_name["tok_embeddings.weight"]
            embed = storage[MetadataIndex("tok_embeddings.weight", [0, 0])]
            storage[MetadataIndex("output.weight", [0, 0])] = embed
        metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)  # type: ignore[arg-type]
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _stack(
        self, ours: str, seen: dict[str, tuple[Path, torch.Size, torch.dtype]]
    ) -> tuple[torch.Size, torch.dtype, str]:
        """The global shape and dtype of a stacked tensor from its parts (which must be exactly the
        adapter's, all alike), and the file of its first part (DCP groups reads by that file)."""
        names, transposed = self.adapter.stacked(ours, self.args)  # type: ignore[misc]
        extra = [n for n in seen if n not in names]
        if extra:
            raise CheckpointError(
                f"{seen[extra[0]][0]}: tensor '{extra[0]}' has no place in this model "
                f"('{ours}' stacks {len(names)} tensors)"
            )
        missing = [n for n in names if n not in seen]
        if missing:
            raise CheckpointError(f"{self.folder} has no tensor '{missing[0]}' (a part of '{ours}')")
        kinds = {seen[n][1:] for n in names}
        if len(kinds) > 1:
            raise CheckpointError(
                f"{self.folder}: the parts of '{ours}' differ in shape or dtype "
                f"({', '.join(sorted(f'{tuple(s)} {d}' for s, d in kinds))})"
            )
        part, dtype = kinds.pop()
        self.parts[ours] = ([(str(seen[n][0]), n) for n in names], transposed)
        shape = torch.Size([len(names), *(reversed(part) if transposed else part)])
        return shape, dtype, str(seen[names[0]][0])

    def _read_stacked(self, fqn: str, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """Our slice of a stacked tensor: the parts it covers, each sliced (and transposed) alone,
        from whichever files hold them (a part may live in another shard than the first)."""
        from safetensors import safe_open

        parts, transposed = self.parts[fqn]
        inner = [slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:])]
        out, files = [], {}
        with contextlib.ExitStack() as stack:
            for path, name in parts[offsets[0] : offsets[0] + lengths[0]]:
                if path not in files:
                    files[path] = stack.enter_context(safe_open(path, framework="pt"))
                piece = files[path].get_slice(name)
                out.append(piece[tuple(inner[::-1])].T if transposed else piece[tuple(inner)])
        return torch.stack(out)

    def _process_read_request(self, f: Any, req: ReadItem, planner: LoadPlanner) -> None:
        if not self.hf_name:  # DCP read the metadata on another rank and handed us its plan
            self.read_metadata()
        fqn = req.storage_index.fqn
        rest = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets[1:], req.lengths[1:]))
        start, length = req.storage_offsets[0], req.lengths[0]
        heads = self.adapter.rotary_heads(fqn, self.args)
        if fqn in self.derived.derived:
            tensor = self.derived.read(fqn, list(req.storage_offsets), list(req.lengths))
        elif fqn in self.parts:
            tensor = self._read_stacked(fqn, list(req.storage_offsets), list(req.lengths))
        elif heads is None:
            tensor = f.get_slice(self.hf_name[fqn])[(slice(start, start + length),) + rest]
        else:
            piece = f.get_slice(self.hf_name[fqn])
            tensor = rotary_rows(lambda rows: piece[(rows,) + rest], piece.get_shape()[0] // heads, start, length)
        target = planner.resolve_tensor(req).detach()
        if is_nf4(target) and length < (rows := f.get_slice(self.hf_name[fqn]).get_shape()[0]):
            # QLoRA on FSDP: this rank's rows of torchao's NF4 of the whole weight (one scaler
            # mean for every shard, as FSDP's all-gather assumes), not an NF4 of the rows alone.
            piece = f.get_slice(self.hf_name[fqn])
            whole = piece[:] if heads is None else rotary_rows(lambda r: piece[r], rows // heads, 0, rows)
            tensor = nf4_rows(whole, target, start)
        if target.size() != tensor.size():
            raise CheckpointError(
                f"{self.folder}: '{fqn}' slice has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def rotary_rows(read: Callable[[slice], torch.Tensor], head_dim: int, start: int, length: int) -> torch.Tensor:
    """Rows [start, start + length) of a q/k weight in our layout, read from the HF one: the whole heads
    the range touches are read and permuted (a row's partner is in its head).

    Args:
        read: reads a slice of rows of the HF weight, returning them as a tensor.
        head_dim: rows per head.
        start: the first row wanted, in our layout.
        length: how many rows are wanted.
    """
    lo, hi = start // head_dim * head_dim, -(-(start + length) // head_dim) * head_dim
    block = permute_from_hf(read(slice(lo, hi)), (hi - lo) // head_dim)
    return block[start - lo : start - lo + length]


def _dtype(name: str, path: Path, tensor: str) -> torch.dtype:
    from safetensors.torch import _getdtype

    try:
        return _getdtype(name)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: tensor '{tensor}' has unsupported dtype {name}") from e


def _raise(error: str | None) -> None:
    if error is not None:
        raise CheckpointError(error)


def load_hf(
    model: nn.Module,
    folder: Path,
    args: Any,
    *,
    complete_model: bool,
    agree: Callable[[str | None], Any] = _raise,
    family: ModelFamily | None = None,
) -> None:
    """Load a Hugging Face folder into `model` (this rank's part, any layout) in place.

    Collective under a process group. Raises CheckpointError on every rank when the folder does not
    fit the model or cannot be read.

    Args:
        model: this rank's model (its part under pipeline parallel; DTensors read their own shards).
        folder: the Hugging Face folder (config.json and safetensors files).
        args: this run's model arguments.
        complete_model: whether `model` is the whole model; then a tensor of the folder the model lacks
            is refused too.
        agree: gathers every rank's error (None: none) and raises the first on all of them, so that a
            bad folder fails everywhere with the same line; the default raises this rank's own.
        family: the model family whose adapter maps names; None takes the family of `args`.
    """
    sd = get_model_state_dict(model)
    # A tied model's state dict has no output.weight: it reads the embeddings once, as they are.
    tied = bool(read_config(folder).get("tie_word_embeddings", False)) and "output.weight" in sd
    adapter = _adapter(family_of(args, family))
    reader = HFReader(folder, args, tied, adapter)
    absent = [k for k in sd if adapter.zero_in_hf is not None and adapter.zero_in_hf.search(k)]
    # LoRA's adapters are not the base's: they keep their own init (B zero: the model is the base).
    adapters = set(adapter_parameters(model))
    read = {k: v for k, v in sd.items() if k not in absent and k not in adapters}  # DCP fills them in place
    error = None
    try:
        check_model_fits(folder, reader.read_metadata().state_dict_metadata, read, "", complete_model)
    except CheckpointError as e:
        error = str(e)
    agree(error)
    try:
        with quiet_single_process():
            dcp.load(read, storage_reader=reader, no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"could not load {folder}: {one_line(e)}") from None
    for key in absent:
        cast(torch.Tensor, sd[key]).zero_()  # a model state dict holds tensors (DTensors)
    set_model_state_dict(model, sd)


# ---------------------------------------------------------------------------------------------
# Export


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise CheckpointError(f"shard size {text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
    unit = m[2].upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = "KMGT".find(unit[:1]) + 1 if unit else 0
    return int(float(m[1]) * base**power)


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut into shards of at most max_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def _checkpoint_tensors(
    info: Any, order: list[str]
) -> tuple[dict[str, torch.Size], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The model tensors' shapes and a loader of a few of them at a time, from a DCP checkpoint or
    a model-only export (memory-mapped, so nothing is read before it is asked for)."""
    if info.kind == "model_only":
        sd = torch.load(info.path / EXPORT_FILE, map_location="cpu", weights_only=True, mmap=True)
        return {k: sd[k].shape for k in order if k in sd}, lambda keys: {k: sd[k] for k in keys}
    saved = dcp.FileSystemReader(str(info.path)).read_metadata().state_dict_metadata

    def tensor(key: str) -> TensorStorageMetadata:
        meta = saved[f"model.{key}"]
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{info.path}: model entry '{key}' is not a tensor")
        return meta

    shapes = {k: tensor(k).size for k in order if f"model.{k}" in saved}

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        part = {k: torch.empty(tensor(k).size, dtype=tensor(k).properties.dtype) for k in keys}
        with quiet_single_process():
            dcp.load({"model": part}, checkpoint_id=str(info.path), no_dist=True)
        return part

    return shapes, load


def _tokenizer_files(spec: str) -> dict[str, Path]:
    """Output name -> file to copy, for a tokenizer spec ("byte", a tokenizer.json, or a folder)."""
    path = Path(spec)
    if spec == "byte":
        return {}
    if path.is_file():  # a tokenizer.json under any name, or a tiktoken file (kept as it is named)
        with path.open("rb") as f:
            is_json = f.read(64).lstrip()[:1] == b"{"
        return {"tokenizer.json" if is_json else path.name: path}
    if path.is_dir():
        return {n: path / n for n in TOKENIZER_FILES if (path / n).is_file()}
    raise CheckpointError(f"the run's tokenizer {spec} no longer exists; pass --tokenizer PATH or --tokenizer byte")


def to_hf_tensors(
    hf: HFAdapter,
    key: str,
    value: torch.Tensor,
    args: Any,
    where: Path,
    load: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """One of our tensors as the HF tensors it becomes: renamed (rotary rows permuted), split into its
    stacked parts, or nothing for one HF has no place for (refused unless zero: the HF model would
    compute something else). Returns HF name -> tensor.

    Args:
        hf: the family's Hugging Face adapter (names, stacked parts, rotary permutation).
        key: our state-dict key of the tensor.
        value: the tensor (full, on the CPU).
        args: the model arguments.
        where: the checkpoint folder, named in errors.
        load: reads our other tensors by key, for a merged one (HFAdapter.merged: written with the
            first of its parts); None: no merged tensors.
    """
    merged = hf.merged(key, args)
    if merged is not None and load is not None:
        name, group, combine = merged
        if key != group[0]:
            return {}  # written with the first part
        others = load(group[1:])
        return {name: combine([value, *(others[k] for k in group[1:])])}
    if hf.zero_in_hf is not None and hf.zero_in_hf.search(key):
        if value.count_nonzero():
            raise CheckpointError(
                f"{where}: '{key}' is nonzero, and a {hf.display_name} model has no place for it "
                "(the export would compute differently)"
            )
        return {}
    stacked = hf.stacked(key, args)
    if stacked is not None:
        names, transposed = stacked
        return {n: value[i].T if transposed else value[i].clone() for i, n in enumerate(names)}  # own storage each
    heads = hf.rotary_heads(key, args)
    return {
        hf.to_hf_name(key): permute_to_hf(value, heads) if heads else value,
        **{n: value.clone() for n in hf.copies(key, args)},  # own storage each (safetensors)
    }


def export_hf(
    step_dir: str | Path,
    output: str | Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | None = None,
) -> Path:
    """Write a checkpoint as a Hugging Face folder of its family (single process); returns the folder.

    Converts one output shard at a time: peak memory is about one shard in the checkpoint's dtype
    plus the same shard in `dtype`, never the whole model.

    Args:
        step_dir: the checkpoint's step folder (a full DCP checkpoint or a model-only export).
        output: the folder to write (config.json, safetensors shards and their index, tokenizer files).
        dtype: the dtype name the weights are written in ("bfloat16", "float32", ...).
        max_shard_bytes: the largest safetensors file, in bytes (a larger tensor gets one of its own).
        tokenizer: the tokenizer spec whose files are copied and whose ids config.json names; None
            takes the checkpoint's job config model.tokenizer ("byte" if it has none).
    """
    from safetensors.torch import save_file

    from torchtitan_amp.data.tokenizer import build_tokenizer

    info = inspect_checkpoint(step_dir)
    family = checkpoint_family(info.meta)
    hf = _adapter(family)
    args = family.args_from_dict(info.meta["model_args"])
    spec = tokenizer or info.meta.get("job_config", {}).get("model", {}).get("tokenizer", "byte")
    files = _tokenizer_files(spec)
    tok = build_tokenizer(spec)
    if tok.vocab_size > args.vocab_size:
        raise CheckpointError(f"tokenizer {spec} has {tok.vocab_size} tokens, the model only {args.vocab_size}")
    with torch.device("meta"):
        order = list(family.build_model(args).state_dict())
    shapes, load = _checkpoint_tensors(info, order)
    missing = [k for k in order if k not in shapes]
    if missing:
        raise CheckpointError(f"{info.path} has no model tensor '{missing[0]}' (not a checkpoint of this model)")
    cfg = hf.hf_config(args, dtype, tok.bos_id, tok.eos_id)  # before any file: it refuses what the format cannot say
    if hf.zero_in_hf is not None:  # tensors the format has no place for must be zero: checked before any file
        absent = [k for k in order if hf.zero_in_hf.search(k)]
        for key, value in load(absent).items():
            to_hf_tensors(hf, key, value, args, info.path)
    target = TORCH_DTYPES[dtype]
    sizes = {k: math.prod(shapes[k]) * target.itemsize for k in order}
    shards = plan_shards(sizes, max_bytes=max_shard_bytes)
    output = Path(output)
    if any(output.glob("*.safetensors")):  # stale shards of another export would mix with ours
        raise CheckpointError(f"{output} already holds safetensors files; export into a new or empty folder")
    output.mkdir(parents=True, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for name, keys in zip(names, shards):
        out, loaded = {}, load(keys)
        for key in keys:
            # each source tensor is freed as soon as it is converted
            for hf_name, value in to_hf_tensors(hf, key, loaded.pop(key), args, info.path, load).items():
                out[hf_name] = value.to(target).contiguous()
                total += out[hf_name].nbytes
        save_file(out, str(output / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
        del out
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (output / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    for out_name, src in files.items():
        shutil.copyfile(src, output / out_name)
    return output
