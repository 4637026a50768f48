"""Generate text from a checkpoint step, a model-only export or a Hugging Face folder.

    python -m torchtitan_amp.tools.generate --config train_configs/debug_model.toml \\
        --checkpoint.step 10 --prompt "The "
    python -m torchtitan_amp.tools.generate --config job.toml --export RUN/checkpoint/step-100 \\
        --prompts-file prompts.txt --max-new-tokens 64 --temperature 0.8 --top-p 0.9 --seed 1 --output out.jsonl
    python -m torchtitan_amp.tools.generate --hf /models/Llama-3.1-8B --model.flavor llama3_8b \\
        --training.seq_len 8192 --prompt "..."
    torchrun --nproc_per_node 2 -m torchtitan_amp.tools.generate ...        (tensor parallel 2)

(or `torchtitan-amp-generate`). Other arguments are train.py's config overrides: the model, the
tokenizer, the precision (the job config's: bf16 autocast where the run trained in bf16, fp32 where
`mixed_precision.enabled = auto` chose fp32) and `training.seq_len`, the rotary tables' length,
which a prompt and its continuation must fit in. The layout is the tool's own: N ranks are tensor
parallel N (no sequence parallel), whatever the run trained on. Only the model is loaded.

Each prompt is encoded with BOS first (with --chat: as a user message through the tokenizer's chat
template, ending with the assistant's generation prompt) and continued greedily (--temperature 0, the default) or by
sampling (--top-k, --top-p, a --seed), until EOS or --max-new-tokens. Rank 0 prints every prompt
and its continuation on stdout (logs go to stderr); --output also writes one JSON line per
prompt: prompt, text, tokens (the new ids, EOS included), stop ("eos" or "length"). With --hf, the
folder's tokenizer.json is used unless the config or the command line sets model.tokenizer. Exit 0,
or 2 after one `error:` line.
See docs/generation.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan_amp.core.environment import require, separate_inductor_cache
from torchtitan_amp.core.errors import ConfigError, DataError
from torchtitan_amp.tools.common import weights_only_overrides

if TYPE_CHECKING:
    from torchtitan_amp.config import JobConfig
    from torchtitan_amp.eval.generation import ModelRunner, Sampling

logger = logging.getLogger("torchtitan_amp")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    # No abbreviations: an unknown argument is train.py's override, passed on whole.
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Other arguments: train.py's.", allow_abbrev=False
    )
    p.add_argument("--config", metavar="TOML", help="the run's job config (job.config_file)")
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument(
        "--checkpoint.step",
        dest="step",
        type=int,
        metavar="N",
        help="step-N of the run's checkpoint folder (job.dump_folder / checkpoint.folder)",
    )
    weights.add_argument(
        "--export",
        metavar="DIR",
        help="a model-only export (a step folder with model.pt), or any checkpoint step folder: its weights",
    )
    weights.add_argument("--hf", metavar="DIR", help="a Hugging Face model folder (config.json + *.safetensors)")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt")
    prompts.add_argument(
        "--prompts-file", metavar="FILE", help='one prompt per line; a .jsonl file: {"prompt": ...} per line'
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (fewer at EOS)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens holding this mass")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--output", metavar="FILE", help="also write one JSON line per prompt here")
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the tokenizer's chat template: each prompt is a user message and the model answers "
        "as the assistant (docs/post_training.md)",
    )
    return p.parse_known_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--prompts-file {path}: cannot read it ({e.__class__.__name__}: {e})") from None
    if path.suffix != ".jsonl":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = [_jsonl_prompt(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise DataError(f"--prompts-file {path} holds no prompt")
    return prompts


def _jsonl_prompt(path: Path, n: int, line: str) -> str:
    try:
        prompt = json.loads(line).get("prompt")
    except (json.JSONDecodeError, AttributeError):
        prompt = None
    if not isinstance(prompt, str):
        raise DataError(f'--prompts-file {path} line {n}: expected a JSON object with a "prompt" string')
    return prompt


def _config_argv(args: argparse.Namespace, config_argv: list[str], world_size: int) -> list[str]:
    """train.py's command line for generating: the weights to load and the tool's layout (tensor
    parallel over every rank, without sequence or loss parallel), after the user's overrides."""
    from torchtitan_amp.config import load_config

    own = ["--job.config_file", args.config] if args.config else []
    if args.step is not None:
        own += ["--checkpoint.load_step", str(args.step)]
    else:
        folder = Path(args.export or args.hf)
        flag = "--export" if args.export else "--hf"
        if not folder.is_dir():
            raise ConfigError(f"{flag} {folder}: no such folder")
        if args.hf and not (folder / "config.json").is_file():
            raise ConfigError(f"--hf {folder} has no config.json: not a Hugging Face model folder")
        own += ["--checkpoint.initial_load_path", str(folder)]
    user = load_config([*own, *config_argv])
    if args.hf and "model.tokenizer" not in user.explicit and (Path(args.hf) / "tokenizer.json").is_file():
        own += ["--model.tokenizer", args.hf]
    layout = {
        "tensor_parallel_degree": world_size,
        "data_parallel_shard_degree": 1,
        "data_parallel_replicate_degree": 1,
        "pipeline_parallel_degree": 1,
        "context_parallel_degree": 1,
        "expert_parallel_degree": 1,
        "enable_sequence_parallel": "false",
        "disable_loss_parallel": "true",
    }
    forced = [arg for name, value in layout.items() for arg in (f"--parallelism.{name}", str(value))]
    # The run's evaluations (and their sample prompts) are not the tool's business.
    return [
        *own,
        *config_argv,
        *forced,
        "--activation_checkpoint.mode",
        "none",
        "--compile.enable",
        "false",
        "--validation.enable",
        "false",
        "--validation.sample_prompts",
        "",
    ]


@dataclass(frozen=True)
class Loaded:
    """A checkpoint's model, ready to generate on this rank."""

    runner: ModelRunner
    tokenizer: Any  # tokenizer.Tokenizer
    checkpoint: str
    precision: str  # the precision plan's decision line


def _check_lengths(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    from torchtitan_amp.eval.generation import first_too_long

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    too_long = first_too_long(prompts, max_new_tokens, max_seq_len)
    if too_long is not None:
        i, length, _ = too_long
        raise ConfigError(
            f"prompt {i} has {length} tokens: with --max-new-tokens {max_new_tokens} it does "
            f"not fit training.seq_len = {max_seq_len} (the rotary tables' length); shorten it, "
            "generate fewer tokens or raise --training.seq_len"
        )


def load(
    config: JobConfig, prompts: list[str], max_new_tokens: int, chat: bool = False
) -> tuple[Loaded, list[list[int]]]:
    """Every config-time check (the prompts' lengths included) before any process group, then the
    model built on this rank's layout with the checkpoint's weights. Every rank calls it.

    Args:
        config: the job config (model, checkpoint, layout).
        prompts: the prompts' texts, encoded with BOS first.
        max_new_tokens: the tokens generated at most per prompt (with the prompt, they must fit
            training.seq_len).
        chat: each prompt is a user message, rendered by the tokenizer's chat template with the
            generation prompt (data/chat.py's chat_prompt_ids).
    """
    from torchtitan_amp.checkpoint import CheckpointManager
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.eval.generation import ModelRunner
    from torchtitan_amp.train.job import build_model_parts
    from torchtitan_amp.train.job import resolve as resolve_job

    info = process_groups.resolve(config)
    process_groups.set_device(info)
    job = resolve_job(config, info.world_size, info.device.type)
    assert job.tokenizer is not None  # resolve builds one outside a dry run
    if chat:
        from torchtitan_amp.data.chat import chat_prompt_ids

        ids = [chat_prompt_ids([{"role": "user", "content": text}], job.tokenizer) for text in prompts]
    else:
        ids = [job.tokenizer.encode(text, bos=True, eos=False) for text in prompts]
    _check_lengths(ids, max_new_tokens, job.model_args.max_seq_len)
    process_groups.init(info, config.comm.init_timeout_seconds)
    if info.world_size > 1:
        job.dims.build_mesh(info.device.type)
    model = build_model_parts(job, info.device, [0]).parts[0]
    manager = CheckpointManager(
        config,
        model=model,
        optimizer=[],
        lr_scheduler=None,
        scaler=None,
        dataloader=None,
        model_args=job.model_args,
        device=info.device,
    )
    manager.load()
    runner = ModelRunner.for_plan(model.eval(), job.plan, job.dims.tp, sequence_parallel=False)
    return Loaded(runner, job.tokenizer, str(manager.loaded_path), job.plan.decision), ids


def generate_texts(args: argparse.Namespace, config_argv: list[str]) -> list[dict[str, Any]]:
    """Every prompt's record (generation.record), on every rank."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.eval.generation import Sampling, generate, record

    prompts = read_prompts(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory(prefix="torchtitan_amp_generate_") as scratch:
        config = load_config(weights_only_overrides(_config_argv(args, config_argv, world_size), scratch))
        loaded, ids = load(config, prompts, args.max_new_tokens, args.chat)
    _log_start(loaded, world_size, sampling)
    return [
        record(
            text,
            generate(loaded.runner, prompt, args.max_new_tokens, sampling, loaded.tokenizer.eos_id),
            loaded.tokenizer,
        )
        for text, prompt in zip(prompts, ids)
    ]


def _log_start(loaded: Loaded, world_size: int, sampling: Sampling) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        how = (
            "greedy"
            if sampling.greedy
            else (
                f"sampling (temperature {sampling.temperature}, top-k "
                f"{sampling.top_k or 'off'}, top-p {sampling.top_p}, seed {sampling.seed})"
            )
        )
        logger.info(
            "generating from %s on %d rank%s (tensor parallel), %s; precision: %s",
            loaded.checkpoint,
            world_size,
            "s" if world_size > 1 else "",
            how,
            loaded.precision,
        )


def main(argv: list[str]) -> int:
    args, config_argv = parse_args(argv)
    require()
    separate_inductor_cache()
    from torchtitan_amp.core.errors import UserError
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.main import fail

    try:
        records = generate_texts(args, config_argv)
    except UserError as e:
        return fail(e, e.exit_code)
    finally:
        process_groups.shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        for r in records:
            print(r["prompt"] + r["text"], flush=True)
        if args.output:
            Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return 0


def cli() -> None:
    from torchtitan_amp.main import exit_process, setup_logging

    setup_logging(sys.stderr)
    exit_process(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
