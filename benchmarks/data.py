#!/usr/bin/env python3
"""Pre-training data at scale: prepare throughput, loader start-up and memory, windows/s.

    python -m benchmarks.data                       # 1 GB synthetic corpus, ~7 min on 2 cores
    python -m benchmarks.data --gb 0.1 --bpe-mb 16  # a quick look

1. Writes a synthetic corpus of --gb GB of .jsonl text (Zipf-distributed pseudo-words, documents
   of 0.5-8 kB) under --work.
2. Prepare throughput, input MB/s per worker with 1 and 2 workers: the byte tokenizer on the whole
   corpus; a BPE tokenizer.json (8k vocab, trained here on a sample) on the first --bpe-mb MB,
   beside Hugging Face `datasets` (load_dataset("json") + map(batched, num_proc) with the same
   tokenizer, the anchor) on the same files. Every process tokenizes on one thread
   (TOKENIZERS_PARALLELISM=false), so MB/s per worker is a per-core figure.
3. Loader start-up (build_dataloader) and resident memory growth (RSS before the loader is built to
   after its first batch, in a fresh process) on ~0.1 GB and ~1 GB token corpora, and the
   in-memory `path:` loader on the 0.1 GB one for contrast.
4. Windows/s the loader delivers at the debug model's shape (seq_len 256, batch 8) with 0 and 2
   loader workers, against what the trainer consumes: batch / measured step time of the debug
   model here (fp32, this CPU).
Page cache is left as it is (warm after prepare): start-up reads only the index either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks._common import emit, header, md_table

# torchdata's StatefulDataLoader calls the deprecated torch.set_vital on construction.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

_FILE_MB = 32


def write_corpus(folder: Path, gb: float, seed: int = 0) -> list[Path]:
    """Files of _FILE_MB MB of {"text": ...} lines; deterministic for a seed."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20_000)]
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    files, target = [], int(gb * (1 << 30))
    written = 0
    while written < target:
        path = folder / f"part_{len(files):04d}.jsonl"
        if not path.exists():
            lines, size = [], 0
            while size < _FILE_MB << 20:
                words = rng.choice(len(vocab), size=int(rng.integers(80, 1300)), p=weights)
                line = json.dumps({"text": " ".join(vocab[w] for w in words)}) + "\n"
                lines.append(line)
                size += len(line)
            path.write_text("".join(lines))
        files.append(path)
        written += path.stat().st_size
    return files


def train_bpe(sample: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [json.loads(line)["text"] for line in sample.read_text().splitlines()[:2000]]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out))
    return out


def time_prepare(files: list[Path], out: Path, tokenizer: str, workers: int) -> float:
    from torchtitan_amp.data.prepare import PrepareConfig, prepare

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    # 16 MB shards: several groups per worker on the smaller inputs too.
    prepare(
        PrepareConfig([str(f) for f in files], out, tokenizer=tokenizer, workers=workers, shard_mb=16, progress=False)
    )
    return time.perf_counter() - start


def time_hf_datasets(files: list[Path], tokenizer: str, workers: int, cache: Path) -> tuple[float, float]:
    """(load_dataset seconds, map seconds): the usual HF recipe, with the same tokenizer."""
    import datasets
    from tokenizers import Tokenizer

    shutil.rmtree(cache, ignore_errors=True)
    datasets.disable_progress_bars()
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    loaded = time.perf_counter()
    tok = Tokenizer.from_file(tokenizer)

    def encode(batch: dict) -> dict:
        return {"ids": [[0] + e.ids + [1] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    return loaded - start, time.perf_counter() - loaded


_PROBE = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
import torch
from torchtitan_amp.data import build_dataloader
from torchtitan_amp.data.tokenizer import ByteTokenizer
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
spec, workers, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
before = rss()
t0 = time.perf_counter()
dl = build_dataloader(spec, ByteTokenizer(), 256, 8, 0, 1, 0, num_workers=workers)
t1 = time.perf_counter()
it = iter(dl)
next(it)
t2 = time.perf_counter()
after = rss()
n, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    next(it)
    n += 1
rate = n * 8 / (time.perf_counter() - start)
print(json.dumps({"startup_s": t1 - t0, "first_batch_s": t2 - t1, "rss_growth_mb": (after - before) / 2**20,
                  "windows_per_s": rate}))
"""


def probe_loader(spec: str, workers: int = 0, seconds: float = 0.0) -> dict:
    """Runs the loader in a fresh process: start-up, first batch, RSS growth, windows/s."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, spec, str(workers), str(seconds)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def debug_step_time(dataset: str, dump: Path) -> float:
    """Median step time of the debug model (seq_len 256, batch 8, fp32) here, in-process."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    trainer_module.peak_flops = lambda device, dtype: 1e12  # skip MFU's matmul benchmark
    args = [
        "--training.dataset",
        dataset,
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "1",
        "--mixed_precision.enabled",
        "false",
        "--job.dump_folder",
        str(dump),
    ]
    trainer_module.Trainer(load_config(args)).train()
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return float(np.median([r["step_time_s"] for r in records if r["step"] > 2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="synthetic corpus size (GB of text)")
    parser.add_argument("--bpe-mb", type=int, default=128, help="MB of the corpus for the BPE and datasets rows")
    parser.add_argument("--work", type=Path, default=Path("/tmp/torchtitan_amp_data_bench"))
    parser.add_argument("--keep", action="store_true", help="keep --work (the corpus is reused when present)")
    parser.add_argument("--output", help="also write the report here")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    work = args.work
    t0 = time.perf_counter()
    files = write_corpus(work / "text", args.gb)
    text_mb = sum(f.stat().st_size for f in files) / 2**20
    gen_s = time.perf_counter() - t0
    bpe_files = files[: max(1, args.bpe_mb // _FILE_MB)]
    bpe_mb = sum(f.stat().st_size for f in bpe_files) / 2**20
    bpe = train_bpe(files[0], work / "bpe.json")

    rows = []
    for workers in (1, 2):
        s = time_prepare(files, work / "byte", "byte", workers)
        rows.append(
            [
                f"prepare, byte tokenizer, {workers} worker(s)",
                f"{text_mb:.0f}",
                f"{s:.1f}",
                f"{text_mb / s:.1f}",
                f"{text_mb / s / workers:.1f}",
            ]
        )
    byte_tokens = work / "byte"  # the 2-worker output (identical to the 1-worker one)
    for workers in (1, 2):
        s = time_prepare(bpe_files, work / "bpe", str(bpe), workers)
        rows.append(
            [
                f"prepare, BPE 8k tokenizer.json, {workers} worker(s)",
                f"{bpe_mb:.0f}",
                f"{s:.1f}",
                f"{bpe_mb / s:.1f}",
                f"{bpe_mb / s / workers:.1f}",
            ]
        )
        load_s, map_s = time_hf_datasets(bpe_files, str(bpe), workers, work / "hf_cache")
        rows.append(
            [
                f"HF datasets load_dataset + map, same BPE, num_proc {workers}",
                f"{bpe_mb:.0f}",
                f"{load_s:.1f} + {map_s:.1f}",
                f"{bpe_mb / (load_s + map_s):.1f}",
                f"{bpe_mb / (load_s + map_s) / workers:.1f} (map alone: {bpe_mb / map_s / workers:.1f})",
            ]
        )
    prepare_table = md_table(["run", "input MB", "seconds", "MB/s", "MB/s per worker"], rows)

    # Token corpora of ~0.1 GB and ~1 GB (byte tokens are 2 bytes per input byte).
    corpora = {}
    for label, gb in (("0.1 GB", 0.1), ("1 GB", 1.0)):
        n = max(1, round(gb / 2 * 1024 / _FILE_MB))
        if n <= len(files):
            time_prepare(files[:n], work / f"tokens_{label}", "byte", 2)
            corpora[label] = work / f"tokens_{label}"
    corpora[f"{2 * text_mb / 1024:.1f} GB (whole corpus)"] = byte_tokens
    from torchtitan_amp.data.index import total_bytes

    loader_rows = []
    for folder in corpora.values():
        r = probe_loader(f"tokens:{folder}")
        loader_rows.append(
            [
                f"tokens: {total_bytes(folder) / 2**30:.2f} GB",
                f"{r['startup_s'] * 1000:.0f} ms",
                f"{r['first_batch_s'] * 1000:.1f} ms",
                f"{r['rss_growth_mb']:.1f} MB",
            ]
        )
    small = files[: max(1, round(0.05 * 1024 / _FILE_MB))]
    (work / "small_text").mkdir(exist_ok=True)
    for f in small:
        dst = work / "small_text" / f.name
        if not dst.exists():
            os.link(f, dst)
    r = probe_loader(f"path:{work / 'small_text'}")
    loader_rows.append(
        [
            f"path: (in memory) {sum(f.stat().st_size for f in small) / 2**30:.2f} GB text",
            f"{r['startup_s'] * 1000:.0f} ms",
            f"{r['first_batch_s'] * 1000:.1f} ms",
            f"{r['rss_growth_mb']:.1f} MB",
        ]
    )
    loader_table = md_table(["dataset", "start-up (build_dataloader)", "first batch", "RSS growth"], loader_rows)

    step_s = debug_step_time(f"tokens:{byte_tokens}", work / "train")
    need = 8 / step_s
    rate_rows = [[f"trainer need: debug model, fp32, this CPU (step {step_s * 1000:.0f} ms)", f"{need:.0f}", "1.0x"]]
    for workers in (0, 2):
        r = probe_loader(f"tokens:{byte_tokens}", workers, seconds=5.0)
        rate_rows.append(
            [
                f"tokens: loader, {workers} loader workers",
                f"{r['windows_per_s']:.0f}",
                f"{r['windows_per_s'] / need:.0f}x",
            ]
        )
    rate_table = md_table(["", "windows/s (seq_len 256)", "vs need"], rate_rows)

    report = (
        "\n\n".join(
            [
                header("Data: prepare, loader start-up, windows/s"),
                f"corpus: {text_mb:.0f} MB of synthetic .jsonl text in {len(files)} files (written in {gen_s:.0f} s); "
                f"BPE and datasets rows on the first {bpe_mb:.0f} MB",
                prepare_table,
                loader_table,
                rate_table,
            ]
        )
        + "\n"
    )
    emit(report, args.output)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
