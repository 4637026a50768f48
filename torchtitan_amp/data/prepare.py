"""Tokenize raw text once, in parallel, into the token-shard folder data/index.py describes.

    inputs -> units (sources.py) -> groups of ~shard_mb input -> one shard per group and split

A group's shard depends only on the group, so the output is byte-identical for any --workers, and
the groups split across machines (--num-shards K --shard-index i takes groups g with g % K == i).
Crash safety: every shard is written as .tmp and renamed, then a done marker is written in
<out>/.prepare/; index.json is written last (merge). A killed prepare leaves no index.json, which
every reader refuses; rerunning the same command skips the groups already done. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data import index as fmt
from torchtitan_amp.data.sources import Unit, iter_documents, plan_units
from torchtitan_amp.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

_BATCH_CHARS = 4 << 20  # texts are tokenized in batches of about this many characters


@dataclass(frozen=True)
class PrepareConfig:
    inputs: list[str]
    output: Path
    tokenizer: str = "byte"
    text_column: str = "text"
    hf_config: str | None = None
    hf_split: str = "train"
    workers: int = 1
    shard_mb: float = 256.0
    validation_fraction: float = 0.0
    split_seed: int = 0
    num_shards: int = 1
    shard_index: int = 0
    overwrite: bool = False
    progress: bool = True


def _check_config(cfg: PrepareConfig) -> None:
    if cfg.workers < 1:
        raise DataError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.shard_mb <= 0:
        raise DataError(f"--shard-mb must be > 0, got {cfg.shard_mb}")
    if not 0.0 <= cfg.validation_fraction < 1.0:
        raise DataError(f"--validation-fraction must be in [0, 1), got {cfg.validation_fraction}")
    if cfg.num_shards < 1 or not 0 <= cfg.shard_index < cfg.num_shards:
        raise DataError(f"--shard-index must be in [0, --num-shards), got {cfg.shard_index} of {cfg.num_shards}")


# --- the plan: everything the output depends on -------------------------------------------------


def _group_units(units: list[Unit], shard_bytes: int) -> list[list[Unit]]:
    groups: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        if groups[-1] and size >= shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += unit.size
    return groups if groups[0] else []


def build_plan(cfg: PrepareConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    shard_bytes = max(1, int(cfg.shard_mb * (1 << 20)))
    groups = _group_units(plan_units(cfg.inputs, shard_bytes, cfg.hf_config, cfg.hf_split), shard_bytes)
    if not groups:
        raise DataError(f"inputs {', '.join(cfg.inputs)} hold no documents")
    return {
        "tokenizer": {
            "spec": cfg.tokenizer,
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": fmt.dtype_for_vocab(tokenizer.vocab_size),
        "text_column": cfg.text_column,
        "validation": {
            "fraction": cfg.validation_fraction,
            "seed": cfg.split_seed,
            "rule": "blake2b-64(utf8 text, key=seed) < fraction * 2^64",
        },
        "inputs": cfg.inputs,
        "groups": [[u.to_json() for u in g] for g in groups],
    }


def plan_fingerprint(plan: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


# --- one group -> one shard per split -------------------------------------------------------------


class _ShardWriter:
    """Appends tokens to <final>.tmp, hashing as it goes; close() renames it into place."""

    def __init__(self, final: Path, dtype: np.dtype) -> None:
        self.final, self.dtype = final, dtype
        self.tmp = final.with_name(final.name + ".tmp")
        self.file = self.tmp.open("wb")
        self.digest = hashlib.sha256()
        self.num_tokens = self.num_docs = 0
        self.max_token_id = -1

    def write(self, tokens: np.ndarray, num_docs: int) -> None:
        if not tokens.size:
            return
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.num_tokens += tokens.size
        self.num_docs += num_docs
        self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def close(self, root: Path) -> dict[str, Any] | None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if not self.num_tokens:
            self.tmp.unlink()
            return None
        os.replace(self.tmp, self.final)
        return {
            "file": self.final.relative_to(root).as_posix(),
            "num_tokens": self.num_tokens,
            "num_docs": self.num_docs,
            "max_token_id": self.max_token_id,
            "sha256": self.digest.hexdigest(),
        }


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(spec: str) -> Tokenizer:
    # Built once per worker process: workers get the spec, not a pickled tokenizer.
    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = build_tokenizer(spec)
    return _TOKENIZERS[spec]


def _encode(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """BOS + ids + EOS of every text, concatenated (int64)."""
    if isinstance(tokenizer, ByteTokenizer):
        # The byte ids are the UTF-8 bytes: numpy does it without a Python int per byte.
        raw = [t.encode("utf-8") for t in texts]
        lengths = np.array([len(r) + 2 for r in raw], dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        out = np.empty(int(ends[-1]), dtype=np.int64)
        is_text = np.ones(out.size, dtype=bool)
        is_text[starts] = is_text[ends - 1] = False
        out[starts], out[ends - 1] = tokenizer.bos_id, tokenizer.eos_id
        out[is_text] = np.frombuffer(b"".join(raw), dtype=np.uint8)
        return out
    ids = tokenizer.encode_batch(texts)
    total = sum(len(i) + 2 for i in ids)
    bos, eos = [tokenizer.bos_id], [tokenizer.eos_id]
    return np.fromiter(chain.from_iterable(chain(bos, i, eos) for i in ids), dtype=np.int64, count=total)


def _is_validation(text: str, fraction: float, key: bytes) -> bool:
    # Content-keyed: the same document lands in the same split whatever the sharding, and
    # duplicates of a held-out document cannot leak into train.
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(h, "little") < fraction * 2.0**64


def _batches(units: list[Unit], column: str) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for unit in units:
        for text in iter_documents(unit, column):
            batch.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def run_group(job: dict[str, Any]) -> dict[str, Any]:
    """Tokenizes group job["group"] into its train (and validation) shard; writes its done marker."""
    out, group, plan = Path(job["out"]), job["group"], job["plan"]
    tokenizer = _tokenizer(plan["tokenizer"]["spec"])
    dtype = fmt.DTYPES[plan["dtype"]]
    fraction = plan["validation"]["fraction"]
    key = str(plan["validation"]["seed"]).encode()
    writers = {s: _ShardWriter(out / fmt.shard_name(s, group), dtype) for s in fmt.SPLITS if s == "train" or fraction}
    for texts in _batches([Unit(**u) for u in plan["groups"][group]], plan["text_column"]):
        held = [_is_validation(t, fraction, key) for t in texts] if fraction else [False] * len(texts)
        for split, wanted in (("train", False), ("validation", True)):
            chosen = [t for t, h in zip(texts, held) if h == wanted]
            if chosen:
                writers[split].write(_encode(tokenizer, chosen), len(chosen))
    done = {"plan": job["fingerprint"], "group": group, **{s: w.close(out) for s, w in writers.items()}}
    _write_json_atomic(_done_path(out, group), done)
    return done


# --- the work folder, resume and merge --------------------------------------------------------


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _done_path(out: Path, group: int) -> Path:
    return out / fmt.WORK_DIR / "done" / f"{group:06d}.json"


def _part_path(out: Path, shard_index: int, num_shards: int) -> Path:
    return out / fmt.WORK_DIR / f"part-{shard_index:05d}-of-{num_shards:05d}.json"


def _prepare_output(cfg: PrepareConfig) -> None:
    out = cfg.output
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file; choose a folder")
    ours = (out / fmt.INDEX_NAME).exists() or (out / fmt.WORK_DIR).exists()
    if (out / fmt.INDEX_NAME).exists() and not cfg.overwrite:
        raise DataError(f"{out} is already prepared ({fmt.INDEX_NAME} exists); pass --overwrite to prepare it again")
    if out.exists() and any(out.iterdir()) and not ours:
        raise DataError(f"output {out} exists and is not a prepare output; choose an empty or new folder")
    if ours and cfg.overwrite:
        shutil.rmtree(out)
    (out / fmt.WORK_DIR / "done").mkdir(parents=True, exist_ok=True)
    for split in fmt.SPLITS:
        (out / split).mkdir(exist_ok=True)


def _claim_plan(out: Path, plan: dict[str, Any]) -> str:
    """Writes plan.json, or checks that an unfinished prepare (or another machine) has the same."""
    fingerprint = plan_fingerprint(plan)
    path = out / fmt.WORK_DIR / "plan.json"
    tmp = path.with_name(f"plan.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
    try:
        os.link(tmp, path)  # atomic, and never replaces another machine's plan
    except FileExistsError:
        if plan_fingerprint(json.loads(path.read_text())) != fingerprint:
            raise DataError(
                f"{out} holds an unfinished prepare of other inputs or options; rerun it with those, "
                "or pass --overwrite to start again"
            ) from None
    finally:
        tmp.unlink()
    return fingerprint


def _is_done(out: Path, group: int, fingerprint: str) -> dict[str, Any] | None:
    path = _done_path(out, group)
    if not path.is_file():
        return None
    done = json.loads(path.read_text())
    shards = [done[s] for s in fmt.SPLITS if done.get(s)]
    intact = all((out / s["file"]).is_file() for s in shards)
    return done if done["plan"] == fingerprint and intact else None


def _run_groups(jobs: list[dict[str, Any]], workers: int, sizes: list[int], bar: Any) -> list[dict[str, Any]]:
    if workers == 1 or len(jobs) == 1:
        results = []
        for job, size in zip(jobs, sizes):
            results.append(run_group(job))
            bar.update(size)
        return results
    results = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_group, job): size for job, size in zip(jobs, sizes)}
        for future in as_completed(futures):
            results.append(future.result())
            bar.update(futures[future])
    return results


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, desc="prepare", disable=not enabled)


def prepare(cfg: PrepareConfig) -> Path | None:
    """Runs this machine's groups; returns index.json's path once the folder is complete (num_shards
    1), else None after writing this machine's partial index (merge completes the folder)."""
    _check_config(cfg)
    # One core per worker: the tokenizers library would otherwise start a thread pool in each.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    plan = build_plan(cfg, _tokenizer(cfg.tokenizer))
    _prepare_output(cfg)
    fingerprint = _claim_plan(cfg.output, plan)
    mine = [g for g in range(len(plan["groups"])) if g % cfg.num_shards == cfg.shard_index]
    size = {g: sum(u["size"] for u in plan["groups"][g]) for g in mine}
    done = {g: d for g in mine if (d := _is_done(cfg.output, g, fingerprint))}
    todo = [g for g in mine if g not in done]
    jobs = [{"out": str(cfg.output), "group": g, "plan": plan, "fingerprint": fingerprint} for g in todo]
    with _progress_bar(sum(size.values()), sum(size[g] for g in done), cfg.progress) as bar:
        for result in _run_groups(jobs, min(cfg.workers, max(1, len(jobs))), [size[g] for g in todo], bar):
            done[result["group"]] = result
    part = {"plan": fingerprint, "groups": [done[g] for g in mine]}
    _write_json_atomic(_part_path(cfg.output, cfg.shard_index, cfg.num_shards), part)
    return merge(cfg.output) if cfg.num_shards == 1 else None


def merge(out: Path) -> Path:
    """Combines the partial indexes of every --shard-index into index.json; removes the work folder."""
    work = out / fmt.WORK_DIR
    if (out / fmt.INDEX_NAME).is_file() and not work.is_dir():
        return out / fmt.INDEX_NAME
    if not (work / "plan.json").is_file():
        raise DataError(f"{out} has no unfinished prepare to merge (no {fmt.WORK_DIR}/plan.json)")
    plan = json.loads((work / "plan.json").read_text())
    fingerprint = plan_fingerprint(plan)
    parts = sorted(work.glob("part-*-of-*.json"))
    counts = {p.name.rsplit("-of-", 1)[1].removesuffix(".json") for p in parts}
    if len(counts) != 1:
        raise DataError(
            f"{work}: partial indexes {', '.join(p.name for p in parts) or 'none'} "
            "do not come from one --num-shards run"
        )
    num_shards = int(counts.pop())
    have = {int(p.name.split("-")[1]) for p in parts}
    missing = sorted(set(range(num_shards)) - have)
    if missing:
        raise DataError(
            f"{out}: partial index of --shard-index {', '.join(map(str, missing))} of {num_shards} "
            "is missing; run those first"
        )
    groups: dict[int, dict[str, Any]] = {}
    for p in parts:
        part = json.loads(p.read_text())
        if part["plan"] != fingerprint:
            raise DataError(f"{p}: made from other inputs or options than {work / 'plan.json'}")
        groups.update((d["group"], d) for d in part["groups"])
    absent = sorted(set(range(len(plan["groups"]))) - set(groups))
    if absent:
        raise DataError(f"{out}: groups {absent[:5]} have no shard; rerun their --shard-index")
    splits = {}
    for split in fmt.SPLITS:
        shards = [groups[g][split] for g in sorted(groups) if groups[g].get(split)]
        if split == "train" or plan["validation"]["fraction"]:
            splits[split] = {
                "num_tokens": sum(s["num_tokens"] for s in shards),
                "num_docs": sum(s["num_docs"] for s in shards),
                "shards": shards,
            }
    index = {
        "format": fmt.FORMAT,
        "tokenizer": plan["tokenizer"],
        "dtype": plan["dtype"],
        "text_column": plan["text_column"],
        "validation": plan["validation"],
        "inputs": plan["inputs"],
        "plan": fingerprint,
        "splits": splits,
    }
    _write_json_atomic(out / fmt.INDEX_NAME, index)
    shutil.rmtree(work)
    if (out / "validation").is_dir() and not any((out / "validation").iterdir()):
        (out / "validation").rmdir()
    return out / fmt.INDEX_NAME
