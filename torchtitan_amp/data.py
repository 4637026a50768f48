"""Text corpora -> packed, data-parallel-sharded, resumable (inputs, labels) batches."""

import array
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_amp.errors import DataError
from torchtitan_amp.tokenizer import Tokenizer

_TEXT_SUFFIXES = (".txt", ".md")
_JSONL_SUFFIX = ".jsonl"
_DATASET_FORMS = "'pydoc' or 'path:<.txt/.md/.jsonl file or directory>'"

Sample = tuple[torch.Tensor, torch.Tensor]


def _load_pydoc() -> list[tuple[str, str]]:
    # Ships with CPython, so tests and smoke runs need no download.
    from pydoc_data.topics import topics

    return [(f"pydoc:{key}", topics[key]) for key in sorted(topics)]


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (bad byte at offset {e.start})") from e


def _load_jsonl(path: Path) -> list[tuple[str, str]]:
    docs = []
    for line_no, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path}:{line_no}: expected a JSON object with a string 'text' field")
        docs.append((f"{path}:{line_no}", record["text"]))
    return docs


def _load_file(path: Path) -> list[tuple[str, str]]:
    if path.suffix == _JSONL_SUFFIX:
        return _load_jsonl(path)
    if path.suffix in _TEXT_SUFFIXES:
        return [(str(path), _read_utf8(path))]
    raise DataError(f"{path}: unsupported file type {path.suffix!r} (allowed: .txt, .md, .jsonl)")


def _load_path(root: Path) -> list[tuple[str, str]]:
    if not root.exists():
        raise DataError(f"dataset path {root} does not exist")
    if root.is_file():
        return _load_file(root)
    # Sorted so that document order, and hence every window, is the same on all ranks and runs.
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (*_TEXT_SUFFIXES, _JSONL_SUFFIX))
    if not files:
        raise DataError(f"dataset directory {root} has no .txt, .md or .jsonl files")
    return [doc for path in files for doc in _load_file(path)]


def load_texts(dataset: str) -> list[tuple[str, str]]:
    """Returns (source_name, text) documents; empty documents are dropped."""
    if dataset == "pydoc":
        docs = _load_pydoc()
    elif dataset.startswith("path:") and dataset != "path:":
        docs = _load_path(Path(dataset.removeprefix("path:")))
    else:
        raise DataError(f"unknown dataset {dataset!r} (allowed: {_DATASET_FORMS})")
    docs = [(name, text) for name, text in docs if text]
    if not docs:
        raise DataError(f"dataset {dataset!r} contains no non-empty documents")
    return docs


def tokenize_corpus(docs: Iterable[tuple[str, str]], tokenizer: Tokenizer) -> torch.Tensor:
    """Concatenates BOS + text + EOS of every document into one int32 tensor.

    int32 halves the memory of the long-lived corpus; windows are widened to int64 when sliced.
    """
    ids = array.array("i")
    for _, text in docs:
        ids.extend(tokenizer.encode(text, bos=True, eos=True))
    return torch.frombuffer(ids, dtype=torch.int32) if ids else torch.empty(0, dtype=torch.int32)


# Keyed by (dataset spec, tokenizer.cache_key): every loader in the process (dp ranks in tests,
# train + eval loaders) shares one read-only tensor instead of re-tokenising.
_CORPUS_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def _corpus_tokens(dataset: str, tokenizer: Tokenizer) -> torch.Tensor:
    # A tokenizer without a cache_key (e.g. a test double) cannot be told apart from a
    # differently configured one of the same type, so it is never cached.
    cache_key = getattr(tokenizer, "cache_key", None)
    if cache_key is None:
        return tokenize_corpus(load_texts(dataset), tokenizer)
    key = (dataset, cache_key)
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE[key] = tokenize_corpus(load_texts(dataset), tokenizer)
    return _CORPUS_CACHE[key]


class PackedTextDataset(IterableDataset):
    """Infinite stream of (input, label) windows of `seq_len` tokens, sharded by data-parallel rank.

    The token stream is cut into non-overlapping windows of seq_len + 1 tokens. Each epoch draws a
    permutation of all windows from a generator seeded with seed + epoch, identical on every rank;
    rank r takes permutation positions r, r + R, r + 2R, ... so ranks see disjoint windows, and the
    remainder is dropped so every rank gets the same number of windows per epoch.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, dp_rank: int, dp_world_size: int, seed: int) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise DataError(
                f"dp_rank must be in [0, dp_world_size), got dp_rank={dp_rank}, dp_world_size={dp_world_size}"
            )
        window = seq_len + 1
        needed = dp_world_size * window
        if tokens.numel() < needed:
            raise DataError(
                f"corpus has {tokens.numel()} tokens but needs at least {needed} "
                f"(dp_world_size {dp_world_size} x (seq_len {seq_len} + 1))"
            )
        self._tokens = tokens
        self._window = window
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._seed = seed
        self._num_windows = tokens.numel() // window
        self.num_windows_per_epoch = self._num_windows // dp_world_size
        self._epoch = 0
        self._index = 0
        self._rank_windows_epoch = -1
        self._rank_windows = torch.empty(0, dtype=torch.int64)

    @property
    def epoch(self) -> int:
        """Epoch of the most recently produced sample (0 before the first)."""
        return self._epoch

    def _windows_of_epoch(self, epoch: int) -> torch.Tensor:
        if epoch != self._rank_windows_epoch:
            generator = torch.Generator().manual_seed(self._seed + epoch)
            permutation = torch.randperm(self._num_windows, generator=generator)
            stop = self.num_windows_per_epoch * self._dp_world_size
            self._rank_windows = permutation[self._dp_rank : stop : self._dp_world_size]
            self._rank_windows_epoch = epoch
        return self._rank_windows

    def _next_sample(self) -> Sample:
        if self._index == self.num_windows_per_epoch:
            self._epoch += 1
            self._index = 0
        start = int(self._windows_of_epoch(self._epoch)[self._index]) * self._window
        # Advance before returning so a state_dict taken now resumes with the following sample.
        self._index += 1
        window = self._tokens[start : start + self._window].to(torch.int64)
        return window[:-1], window[1:]

    def __iter__(self) -> Iterator[Sample]:
        # All progress lives on the dataset (not in the generator), which is what state_dict saves.
        while True:
            yield self._next_sample()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        epoch, index = state_dict.get("epoch"), state_dict.get("index")
        if not isinstance(epoch, int) or not isinstance(index, int) or epoch < 0:
            raise DataError(f"dataset state needs int 'epoch' >= 0 and int 'index', got {state_dict!r}")
        if not 0 <= index <= self.num_windows_per_epoch:
            raise DataError(
                f"dataset state index {index} is outside [0, {self.num_windows_per_epoch}] windows per epoch "
                "(was it saved with a different dataset, seq_len or dp_world_size?)"
            )
        self._epoch = epoch
        self._index = index


def _stack_samples(samples: list[Sample]) -> Sample:
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


class ParallelAwareDataLoader(StatefulDataLoader):
    """StatefulDataLoader whose state is stored under this dp rank's key, as in torchtitan.

    Keying by rank lets a distributed checkpoint hold every rank's position side by side, and makes
    loading another rank's (or another dp world size's) state fail loudly instead of replaying data.
    """

    def __init__(self, dataset: PackedTextDataset, dp_rank: int, dp_world_size: int, batch_size: int) -> None:
        if batch_size < 1:
            raise DataError(f"local_batch_size must be >= 1, got {batch_size}")
        super().__init__(dataset, batch_size=batch_size, num_workers=0, collate_fn=_stack_samples)
        self._packed = dataset
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_key = f"dp_rank_{dp_rank}"

    @property
    def epoch(self) -> int:
        """Epoch of the most recently loaded sample; a loaded state shows here once iteration resumes."""
        return self._packed.epoch

    @property
    def num_windows_per_epoch(self) -> int:
        """Samples this rank sees per epoch (the same on every rank)."""
        return self._packed.num_windows_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_key: super().state_dict(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # An empty state means "start from the beginning" (e.g. a checkpoint without data state).
        if not state_dict:
            return
        if state_dict.get("world_size") != self.dp_world_size:
            raise DataError(
                f"dataloader state was saved with dp world_size {state_dict.get('world_size')}, "
                f"but this run has {self.dp_world_size}; resharding data state is not supported"
            )
        if self._rank_key not in state_dict:
            saved = sorted(k for k in state_dict if k.startswith("dp_rank_"))
            raise DataError(f"dataloader state has no '{self._rank_key}' entry (found: {', '.join(saved) or 'none'})")
        super().load_state_dict(state_dict[self._rank_key])


def build_dataloader(
    dataset: str,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
) -> ParallelAwareDataLoader:
    """Yields (inputs, labels), both int64 [local_batch_size, seq_len], forever."""
    tokens = _corpus_tokens(dataset, tokenizer)
    packed = PackedTextDataset(tokens, seq_len, dp_rank, dp_world_size, seed)
    return ParallelAwareDataLoader(packed, dp_rank, dp_world_size, local_batch_size)
