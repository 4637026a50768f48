"""`python -m torchtitan_amp.data` (console: torchtitan-amp-prepare-data): prepare, merge, verify.

    prepare INPUT... --output DIR [--tokenizer byte|tokenizer.json|HF folder|tiktoken file] [--workers N]
            [--validation-fraction F] [--num-shards K --shard-index I]
    merge DIR                    after all K --shard-index jobs: writes DIR/index.json
    verify DIR [--tokenizer T]   reads every shard: sha256 and token ids (start-up only stats them)

Bad input is one line on stderr and exit code 2. docs/data.md has the walk-through.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_amp.core.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_amp.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize raw text into a token-shard folder")
    p.add_argument(
        "inputs",
        nargs="+",
        help=".txt/.md/.jsonl(.gz/.zst), .parquet, folders, save_to_disk datasets, "
        "hf:<name> (datasets.load_dataset by name)",
    )
    p.add_argument("--output", "-o", required=True, type=Path, help="folder to write (train/, validation/, index.json)")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte', a tokenizer.json, a Hugging Face tokenizer folder "
        "or a tiktoken BPE file (the job's model.tokenizer must be the same)",
    )
    p.add_argument("--text-column", default="text", help="column of .parquet and saved datasets (default: text)")
    p.add_argument("--hf-config", default=None, help="configuration of hf:<name> inputs (e.g. wikitext-103-raw-v1)")
    p.add_argument("--hf-split", default="train", help="split of hf:<name> inputs (default: train)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (output is the same for any)")
    p.add_argument("--shard-mb", type=float, default=256.0, help="input MB per shard (default 256)")
    p.add_argument(
        "--validation-fraction",
        type=float,
        default=0.0,
        help="hold out this fraction of documents as the 'validation' split (tokens:DIR:validation)",
    )
    p.add_argument("--split-seed", type=int, default=0, help="key of the document hash that picks held-out documents")
    p.add_argument("--num-shards", type=int, default=1, help="machines sharing the work (SLURM array size)")
    p.add_argument("--shard-index", type=int, default=0, help="this machine's index in [0, --num-shards)")
    p.add_argument("--overwrite", action="store_true", help="delete a finished or unfinished earlier prepare of DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = sub.add_parser("merge", help="combine the partial indexes of --num-shards K runs into index.json")
    m.add_argument("folder", type=Path)
    v = sub.add_parser("verify", help="check every shard's sha256 and token ids")
    v.add_argument("folder", type=Path)
    v.add_argument("--tokenizer", default=None, help="also check the shards were made with this tokenizer")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _prepare(args: argparse.Namespace) -> str:
    from torchtitan_amp.data.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(
        inputs=args.inputs,
        output=args.output,
        tokenizer=args.tokenizer,
        text_column=args.text_column,
        hf_config=args.hf_config,
        hf_split=args.hf_split,
        workers=args.workers,
        shard_mb=args.shard_mb,
        validation_fraction=args.validation_fraction,
        split_seed=args.split_seed,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    index = prepare(cfg)
    if index is None:
        return f"{args.output}: shard-index {args.shard_index} of {args.num_shards} done; run merge when all are"
    return _summary(args.output)


def _summary(folder: Path) -> str:
    from torchtitan_amp.data.index import read_index

    index = read_index(folder)
    parts = [
        f"{name}: {s['num_tokens']:,} tokens, {s['num_docs']:,} docs, {len(s['shards'])} shards"
        for name, s in index["splits"].items()
    ]
    return f"{folder}: " + "; ".join(parts) + f" ({index['dtype']}); use training.dataset = 'tokens:{folder}'"


def _verify(args: argparse.Namespace) -> str:
    from tqdm import tqdm

    from torchtitan_amp.data.index import total_bytes, verify
    from torchtitan_amp.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer) if args.tokenizer else None
    with tqdm(
        total=total_bytes(args.folder), unit="B", unit_scale=True, desc="verify", disable=args.no_progress
    ) as bar:
        tokens = verify(args.folder, tokenizer, bar.update)
    return f"{args.folder}: ok (" + ", ".join(f"{s} {n:,} tokens" for s, n in tokens.items()) + ")"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            print(_prepare(args))
        elif args.command == "merge":
            from torchtitan_amp.data.prepare import merge

            merge(args.folder)
            print(_summary(args.folder))
        else:
            print(_verify(args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))
