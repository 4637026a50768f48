"""The small-data path: `pydoc` and `path:` corpora read and tokenised in memory at start-up."""

import array
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data.tokenizer import Tokenizer

_TEXT_SUFFIXES = (".txt", ".md")
_JSONL_SUFFIX = ".jsonl"
_DATASET_FORMS = "'pydoc', 'path:<.txt/.md/.jsonl file or directory>' or 'tokens:<prepared folder>[:split]'"


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


def corpus_tokens(dataset: str, tokenizer: Tokenizer) -> torch.Tensor:
    # A tokenizer without a cache_key (e.g. a test double) cannot be told apart from a
    # differently configured one of the same type, so it is never cached.
    cache_key = getattr(tokenizer, "cache_key", None)
    if cache_key is None:
        return tokenize_corpus(load_texts(dataset), tokenizer)
    key = (dataset, cache_key)
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE[key] = tokenize_corpus(load_texts(dataset), tokenizer)
    return _CORPUS_CACHE[key]
