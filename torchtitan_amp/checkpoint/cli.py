"""`python -m torchtitan_amp.checkpoint {list FOLDER | verify STEP_DIR | export ...}`.

export STEP_DIR OUTPUT.pt [DTYPE]: the model as one torch.save file;
export --format hf STEP_DIR OUTPUT_DIR [--dtype D] [--max-shard-size 5GB] [--tokenizer T]: a
Hugging Face Llama folder (checkpoint/hf.py); of a LoRA checkpoint, its base with the adapters merged;
export --format peft STEP_DIR OUTPUT_DIR: a LoRA checkpoint's adapters in PEFT's format
(checkpoint/lora_export.py).
"""

from __future__ import annotations

import argparse
import sys

from torchtitan_amp.core.errors import CheckpointError, DataError
from torchtitan_amp.core.rules import DTYPES

USAGE = (
    "usage: python -m torchtitan_amp.checkpoint list FOLDER\n"
    "       python -m torchtitan_amp.checkpoint verify STEP_DIR\n"
    "       python -m torchtitan_amp.checkpoint export STEP_DIR OUTPUT.pt [float32|bfloat16|float16]\n"
    "       python -m torchtitan_amp.checkpoint export --format hf STEP_DIR OUTPUT_DIR [--dtype bfloat16] "
    "[--max-shard-size 5GB] [--tokenizer byte|PATH]\n"
    "       python -m torchtitan_amp.checkpoint export --format peft STEP_DIR OUTPUT_DIR"
)


def _is_lora(step_dir: str) -> bool:
    from torchtitan_amp.checkpoint.format import inspect_checkpoint

    return "lora_base" in inspect_checkpoint(step_dir).meta


def _export_lora(fmt: str, step_dir: str, output: str, dtype: str, shard: str, tokenizer: str | None) -> object:
    """A LoRA checkpoint (adapters + the base its manifest names): merged into a Hugging Face
    folder, or its adapters in PEFT's format."""
    from torchtitan_amp.checkpoint.hf import parse_size
    from torchtitan_amp.checkpoint.lora_export import export_merged_hf, export_peft, load_lora_checkpoint

    model, args, family, run_tokenizer, base = load_lora_checkpoint(step_dir)
    if fmt == "peft":
        return export_peft(model, args, output, base_model=base)
    return export_merged_hf(model, args, family, output, dtype, tokenizer or run_tokenizer, parse_size(shard))


def _export_hf(argv: list[str]) -> int:
    from torchtitan_amp.checkpoint.hf import export_hf, parse_size

    parser = argparse.ArgumentParser(prog="python -m torchtitan_amp.checkpoint export --format hf")
    parser.add_argument("--format", choices=["hf", "peft"], required=True)
    parser.add_argument("step_dir")
    parser.add_argument("output")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the written weights")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer files to include (default: the run's model.tokenizer)"
    )
    args = parser.parse_args(argv)
    try:
        if args.format == "peft" or _is_lora(args.step_dir):
            out = _export_lora(args.format, args.step_dir, args.output, args.dtype, args.max_shard_size, args.tokenizer)
        else:
            out = export_hf(args.step_dir, args.output, args.dtype, parse_size(args.max_shard_size), args.tokenizer)
    except (CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str]) -> int:
    # Imported here, not at the top: cli() checks the environment before anything imports torch.
    from torchtitan_amp.checkpoint.format import export_checkpoint, inspect_checkpoint, scan_folder
    from torchtitan_amp.checkpoint.integrity import verify_checksums

    if len(argv) >= 2 and argv[0] == "list":
        complete, problems = scan_folder(argv[1])
        for step, info in sorted(complete.items()):
            print(f"step-{step}\t{info.kind}\tworld_size {info.meta.get('world_size')}\t{info.meta.get('saved_at')}")
        for line in problems:
            print(line)
        return 0
    if len(argv) == 2 and argv[0] == "verify":
        try:
            info = inspect_checkpoint(argv[1])
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        bad = verify_checksums(info.path, info.meta)
        if bad:
            print(f"error: {bad}", file=sys.stderr)
            return 2
        n = len(info.meta.get("crc32") or {})
        print(
            f"{info.path}: complete, {len(info.meta['files'])} files"
            + (f", {n} CRC-32s match" if n else " (saved without checksums: sizes checked)")
        )
        return 0
    if argv[:1] == ["export"] and any(a == "--format" or a.startswith("--format=") for a in argv):
        return _export_hf(argv[1:])
    if len(argv) in (3, 4) and argv[0] == "export":
        dtype = argv[3] if len(argv) == 4 else "float32"
        if dtype not in DTYPES:
            print(f"error: dtype must be one of {', '.join(DTYPES)}", file=sys.stderr)
            return 2
        try:
            print(export_checkpoint(argv[1], argv[2], dtype))
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    print(USAGE, file=sys.stderr)
    return 2


def cli() -> None:
    """Console entry point (`torchtitan-amp-checkpoint`, `python -m torchtitan_amp.checkpoint`)."""
    from torchtitan_amp.core.environment import require

    require()
    sys.exit(main(sys.argv[1:]))
