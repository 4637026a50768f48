"""The token-shard folder format: index.json, what a run checks at start-up, what `verify` checks.

A prepared folder (data/prepare.py writes it) holds

    index.json               written last: its presence means every shard below is complete
    train/shard_000000.bin   raw little-endian uint16 (vocab <= 65536) or uint32 token ids:
    train/shard_000001.bin   BOS doc EOS BOS doc EOS ..., np.memmap-able, `sha256sum`-checkable
    validation/shard_....bin only with --validation-fraction > 0

Start-up (every rank, every run) reads index.json and stats each shard file: O(number of shards),
independent of corpus size. It checks the tokenizer fingerprint and vocab size against the job,
that each shard exists with exactly num_tokens x itemsize bytes, and that the recorded largest id
fits the vocabulary. Reading every byte (sha256 and the real largest id) is `verify`'s job: ~0.3
GB/s per core, minutes for a 50 GB corpus, so it runs once after preparing or copying a corpus.
No torch here: the prepare and verify commands do not need it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_amp.core.errors import DataError

FORMAT = "torchtitan_amp.tokens/1"
INDEX_NAME = "index.json"
WORK_DIR = ".prepare"  # a prepare in progress (or killed); gone once index.json exists
SPLITS = ("train", "validation")
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_HASH_BLOCK = 1 << 24


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 halves disk and page cache whenever every id fits in it."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(split: str, group: int) -> str:
    return f"{split}/shard_{group:06d}.bin"


@dataclass(frozen=True)
class Shard:
    path: Path
    num_tokens: int
    num_docs: int
    max_token_id: int
    sha256: str


@dataclass(frozen=True)
class TokenSplit:
    """One split of a prepared folder, checked against the job and ready to memory-map."""

    index_path: Path
    split: str
    dtype: np.dtype
    shards: tuple[Shard, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)


def parse_spec(spec: str) -> tuple[Path, str]:
    """'tokens:<folder>' is the train split; 'tokens:<folder>:validation' the held-out one."""
    body = spec.removeprefix("tokens:")
    folder, _, split = body.rpartition(":")
    if not folder or split not in SPLITS:
        folder, split = body, "train"
    if not folder:
        raise DataError(
            f"dataset {spec!r} names no folder (allowed: 'tokens:<folder>' or 'tokens:<folder>:validation')"
        )
    return Path(folder), split


def read_index(folder: Path) -> dict[str, Any]:
    path = folder / INDEX_NAME
    if not path.is_file():
        if (folder / WORK_DIR).is_dir():
            raise DataError(
                f"{folder}: prepare did not finish (no {INDEX_NAME}); rerun the same prepare command "
                "to resume, or run `merge` once every --shard-index job is done"
            )
        if not folder.is_dir():
            raise DataError(f"token folder {folder} does not exist")
        raise DataError(
            f"{folder} has no {INDEX_NAME}: not a folder written by `python -m torchtitan_amp.data prepare`"
        )
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise DataError(f"{path}: format {found!r} is not {FORMAT!r}")
    return index


def _check_tokenizer(index_path: Path, recorded: dict[str, Any], tokenizer: Any) -> None:
    if recorded["vocab_size"] != tokenizer.vocab_size:
        raise DataError(
            f"{index_path}: tokens were made with vocab size {recorded['vocab_size']} "
            f"({recorded['spec']}), but this job's tokenizer has {tokenizer.vocab_size}"
        )
    # A test double without a fingerprint can only be checked by vocabulary size.
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint is not None and recorded["fingerprint"] != fingerprint:
        raise DataError(
            f"{index_path}: tokens were made with another tokenizer ({recorded['spec']}, "
            f"{recorded['fingerprint'][:24]}...) than this job's ({fingerprint[:24]}...)"
        )


def _split_shards(index: dict[str, Any], index_path: Path, split: str) -> list[Shard]:
    splits = index.get("splits", {})
    if split not in splits:
        raise DataError(f"{index_path} has no {split!r} split (has: {', '.join(sorted(splits)) or 'none'})")
    return [
        Shard(index_path.parent / s["file"], s["num_tokens"], s["num_docs"], s["max_token_id"], s["sha256"])
        for s in splits[split]["shards"]
    ]


def open_split(spec: str, tokenizer: Any) -> TokenSplit:
    """The start-up check: index, tokenizer, shard presence and size. Reads no token."""
    folder, split = parse_spec(spec)
    index = read_index(folder)
    index_path = folder / INDEX_NAME
    _check_tokenizer(index_path, index["tokenizer"], tokenizer)
    dtype = DTYPES[index["dtype"]]
    shards = _split_shards(index, index_path, split)
    for shard in shards:
        if not shard.path.is_file():
            raise DataError(f"{shard.path}: shard listed in {index_path} is missing")
        size = shard.path.stat().st_size
        if size != shard.num_tokens * dtype.itemsize:
            raise DataError(
                f"{shard.path}: {size} bytes, but {index_path} says {shard.num_tokens} {index['dtype']} "
                "tokens (truncated or replaced; run `python -m torchtitan_amp.data verify`)"
            )
        if shard.max_token_id >= tokenizer.vocab_size:
            raise DataError(f"{shard.path}: token id {shard.max_token_id} >= vocab size {tokenizer.vocab_size}")
    return TokenSplit(index_path, split, dtype, tuple(shards))


def hash_and_max(path: Path, dtype: np.dtype, progress: Callable[[int], None] | None = None) -> tuple[str, int]:
    """sha256 of the file and its largest token id (-1 for an empty file), reading it once in 16 MiB
    blocks.

    Args:
        path: the shard file.
        dtype: the shard's token dtype (a value of DTYPES).
        progress: called with the bytes of each block read; None for no progress.
    """
    digest, largest = hashlib.sha256(), -1
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            ids = np.frombuffer(block, dtype=dtype)
            if ids.size:
                largest = max(largest, int(ids.max()))
            if progress is not None:
                progress(len(block))
    return digest.hexdigest(), largest


def verify(folder: Path, tokenizer: Any | None = None, progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Reads every shard: sha256 against the index and every id against the vocab size.
    Returns tokens per split; raises DataError naming the first bad file.

    Args:
        folder: the prepared data folder (index.json and its shards).
        tokenizer: the tokenizer the shards must have been made with (checked against the index);
            None checks only against the index's own vocab size.
        progress: called with the bytes of each block read; None for no progress.
    """
    index = read_index(folder)
    index_path = folder / INDEX_NAME
    if tokenizer is not None:
        _check_tokenizer(index_path, index["tokenizer"], tokenizer)
    vocab_size = index["tokenizer"]["vocab_size"]
    dtype = DTYPES[index["dtype"]]
    tokens = {}
    for split in index["splits"]:
        shards = _split_shards(index, index_path, split)
        for shard in shards:
            if not shard.path.is_file():
                raise DataError(f"{shard.path}: shard listed in {index_path} is missing")
            digest, largest = hash_and_max(shard.path, dtype, progress)
            if digest != shard.sha256:
                raise DataError(
                    f"{shard.path}: sha256 {digest[:16]}... does not match {index_path} "
                    f"({shard.sha256[:16]}...): the shard is corrupt; prepare it again"
                )
            if largest >= vocab_size:
                raise DataError(f"{shard.path}: token id {largest} >= vocab size {vocab_size}")
        tokens[split] = sum(s.num_tokens for s in shards)
    return tokens


def total_bytes(folder: Path) -> int:
    index = read_index(folder)
    itemsize = DTYPES[index["dtype"]].itemsize
    return sum(s["num_tokens"] * itemsize for split in index["splits"].values() for s in split["shards"])
