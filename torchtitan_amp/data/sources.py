"""Raw text inputs of the prepare step, cut into units of work that stream their documents.

Inputs: .txt / .md (one document per file), .jsonl (one {"text": ...} per line), each optionally
.gz or .zst compressed; .parquet (a named column, read per row group with pyarrow); a folder of
those (sorted, as `path:` sorts, so both paths give the same document order); a Hugging Face
`datasets` dataset saved with save_to_disk (its .arrow files, read with pyarrow: no `datasets`
import); `hf:<name>`, a dataset loaded by name with `datasets.load_dataset` (downloaded and
converted to Arrow by `datasets` itself into its cache, whose .arrow files are then read the same
way). Units depend only on the inputs and the unit size, never on the number of workers, which
is what makes the output byte-identical for any worker count. No torch here.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, cast

from torchtitan_amp.core.errors import DataError

_TEXT = (".txt", ".md")
_COMPRESSED = (".gz", ".zst")
_ALLOWED = ".txt, .md, .jsonl (optionally .gz/.zst), .parquet, a folder, a saved Hugging Face dataset"


@dataclass(frozen=True)
class Unit:
    """Documents of one file, or of a byte range (plain .jsonl) or row group (.parquet) of it."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet" | "arrow"
    start: int = 0  # byte offset (jsonl) or row group (parquet)
    stop: int = -1  # -1: to the end
    size: int = 0  # input bytes: groups units into shards and drives the progress bar
    mtime_ns: int = 0  # part of the plan: a changed input invalidates a half-done prepare

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _kind(path: Path) -> str | None:
    suffixes = path.suffixes[-2:]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in _TEXT:
        return "text"
    if last == ".jsonl":
        return "jsonl"
    if last == ".parquet" and path.suffix == ".parquet":
        return "parquet"
    return None


def _is_hf_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def _hf_files(folder: Path) -> list[Path]:
    state = json.loads((folder / "state.json").read_text())
    return [folder / f["filename"] for f in state.get("_data_files", [])]


def _jsonl_ranges(path: Path, size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """Line-aligned byte ranges of about unit_bytes: lets several workers share one big file."""
    bounds = [0]
    with path.open("rb") as f:
        while bounds[-1] + unit_bytes < size:
            f.seek(bounds[-1] + unit_bytes)
            f.readline()  # to the start of the next line
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    return list(zip(bounds, bounds[1:] + [size]))


def _file_units(path: Path, kind: str, unit_bytes: int) -> list[Unit]:
    stat = path.stat()
    base: dict[str, Any] = dict(path=str(path.resolve()), kind=kind, mtime_ns=stat.st_mtime_ns)
    if kind == "jsonl" and path.suffix == ".jsonl":
        return [Unit(**base, start=a, stop=b, size=b - a) for a, b in _jsonl_ranges(path, stat.st_size, unit_bytes)]
    if kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        return [
            Unit(**base, start=g, stop=g + 1, size=meta.row_group(g).total_byte_size)
            for g in range(meta.num_row_groups)
        ]
    return [Unit(**base, size=stat.st_size)]


def _hub_files(spec: str, config: str | None, split: str) -> list[Path]:
    """The Arrow cache files of `datasets.load_dataset(name, config, split=split)`."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"input {spec!r} needs the `datasets` package: pip install datasets") from e
    name = spec.removeprefix("hf:")
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, unknown name or split: datasets raises many types
        raise DataError(f"input {spec!r}: datasets.load_dataset failed: {' '.join(str(e).split())[:300]}") from e
    files = [Path(f["filename"]) for f in dataset.cache_files]
    if not files:
        raise DataError(f"input {spec!r}: datasets.load_dataset returned an in-memory dataset without cache files")
    return files


def plan_units(inputs: list[str], unit_bytes: int, hf_config: str | None = None, hf_split: str = "train") -> list[Unit]:
    """Every input expanded, in order, to units of at most ~unit_bytes (files are never merged).

    Args:
        inputs: the inputs: files, folders (their supported files, sorted) or `hf:<name>` datasets.
        unit_bytes: the largest unit, in bytes (a JSONL file is cut at line starts, a Parquet file at
            row groups; other files are one unit each).
        hf_config: the configuration name of an `hf:` dataset; None for its default.
        hf_split: the split of an `hf:` dataset.
    """
    units: list[Unit] = []
    for spec in inputs:
        if spec.startswith("hf:"):
            units += [u for p in _hub_files(spec, hf_config, hf_split) for u in _file_units(p, "arrow", unit_bytes)]
            continue
        root = Path(spec)
        if not root.exists():
            raise DataError(f"input {root} does not exist")
        if root.is_dir() and (root / "dataset_dict.json").is_file():
            raise DataError(f"{root} is a Hugging Face DatasetDict; pass one split's folder, e.g. {root / 'train'}")
        if root.is_dir() and _is_hf_dataset(root):
            units += [u for p in _hf_files(root) for u in _file_units(p, "arrow", unit_bytes)]
            continue
        if root.is_file():
            kind = _kind(root)
            if kind is None:
                raise DataError(f"{root}: unsupported input (allowed: {_ALLOWED})")
            units += _file_units(root, kind, unit_bytes)
            continue
        # Sorted like data/text.py's `path:` so both paths give one document order.
        files = sorted(p for p in root.rglob("*") if p.is_file() and _kind(p) is not None)
        if not files:
            raise DataError(f"input folder {root} has no supported files (allowed: {_ALLOWED})")
        units += [u for p in files for u in _file_units(p, _kind(p) or "", unit_bytes)]
    return units


def _open_binary(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        return cast(IO[bytes], gzip.open(path, "rb"))  # a GzipFile: typeshed does not count it an IO[bytes]
    if path.suffix == ".zst":
        import zstandard

        # Buffered for line iteration, which zstandard's reader lacks.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True))
    return path.open("rb")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not valid UTF-8 (bad byte at offset {e.start})") from e


def _line_number(path: Path, offset: int) -> int:
    # Counted only when reporting an error: ranges start mid-file.
    with _open_binary(path) as f:
        return f.read(offset).count(b"\n") + 1


def _jsonl_docs(unit: Unit) -> Iterator[str]:
    path = Path(unit.path)
    with _open_binary(path) as f:
        if unit.start:
            f.seek(unit.start)
        offset = unit.start
        for raw in f:
            if unit.stop >= 0 and offset >= unit.stop:
                break
            line_start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{_line_number(path, line_start)}: not valid JSON ({e})") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(
                    f"{path}:{_line_number(path, line_start)}: expected a JSON object with a string 'text' field"
                )
            yield record["text"]


def _column_strings(table: Any, column: str, where: str) -> list[str | None]:
    import pyarrow as pa

    if column not in table.column_names:
        raise DataError(f"{where}: no column {column!r} (has: {', '.join(table.column_names)}); set --text-column")
    values = table.column(column)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise DataError(f"{where}: column {column!r} has type {values.type}, expected string")
    return values.to_pylist()


def _table_docs(unit: Unit, column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(unit.path)
    if unit.kind == "parquet":
        batches = [pq.ParquetFile(path).read_row_group(unit.start, columns=None)]
    else:
        # save_to_disk writes the Arrow IPC stream format.
        with pa.memory_map(str(path)) as source:
            batches = list(pa.ipc.open_stream(source))
    for batch in batches:
        for text in _column_strings(batch, column, str(path)):
            if text:  # nulls and empty strings are no documents
                yield text


def iter_documents(unit: Unit, text_column: str) -> Iterator[str]:
    """The unit's non-empty documents, in file order."""
    if unit.kind == "text":
        with _open_binary(Path(unit.path)) as f:
            text = _decode(f.read(), unit.path)
        if text:
            yield text
    elif unit.kind == "jsonl":
        for text in _jsonl_docs(unit):
            if text:
                yield text
    else:
        yield from _table_docs(unit, text_column)
