#!/usr/bin/env python3
"""Per-rank memory of a training job: parameters, gradients, optimizer state, transient FSDP/DDP
buffers and activations (with and without activation checkpointing), from shapes alone.

    # Llama 3 8B on 8 GPUs, FSDP, bf16 policy, with the real tokenizer's vocabulary
    python -m torchtitan_amp.tools.estimate_memory --ngpu 8 --job.config_file train_configs/llama3_8b.toml \\
        --dry_run.vocab_size 128256
    # the same with TP 2 and pure-bf16 training
    python -m torchtitan_amp.tools.estimate_memory --ngpu 8 --job.config_file train_configs/llama3_8b.toml \\
        --parallelism.tensor_parallel_degree 2 --training.dtype bfloat16 --mixed_precision.enabled false

    # the debug model, estimate vs a measurement on this CPU (a fresh process builds the model and
    # trains --steps steps; with --ngpu N > 1 it runs under torchrun, one measurement per rank)
    python -m torchtitan_amp.tools.estimate_memory --model.flavor debugmodel --training.seq_len 256 \\
        --training.local_batch_size 8 --measure

Every option other than the ones listed by --help is a train.py config override (`--section.key
value`, `--job.config_file FILE`): flavor, layout (parallel degrees, `--ngpu` ranks) and precision
are read from the job config and decided by the same code as training (ParallelDims,
PrecisionPlan). The arithmetic is `torchtitan_amp.memory` (formulas in its docstrings); this
script is its command line. `train.py --job.dry_run` gives the same numbers by building the model
on the meta device with a fake process group; this estimate builds nothing and takes milliseconds.

--measure sizes the activations as this CPU saves them (memory.activation_bytes with device "cpu":
under causal context parallel, CPU's SDPA builds each query chunk's causal mask, CUDA's kernels
do not), and reports, per rank:
- parameter, gradient and AdamW-state bytes summed over the real tensors after the steps: these
  must equal the estimate exactly (the script exits 1 otherwise);
- resident memory (RSS) of the process: its growth from just before the model is built to the
  peak (VmHWM, reset at that point) during build + steps, and to the end. RSS includes allocator
  slack and lazily loaded kernels, so it matches the estimate only approximately (the test in
  tests/test_tools.py states the tolerance). The child runs with MALLOC_MMAP_THRESHOLD_ set so that
  freed tensors go back to the OS and RSS follows live memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan_amp import memory  # pure Python: no torch import
from torchtitan_amp.config import ConfigError, JobConfig, load_config
from torchtitan_amp.tools.common import child_env, module_cmd

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

MODULE = "torchtitan_amp.tools.estimate_memory"  # how this tool relaunches itself under torchrun

MMAP_THRESHOLD = "131072"  # bytes; glibc serves larger allocations with mmap and unmaps them on free


# ---------------------------------------------------------------------------------------------
# Estimate


def apply_shape(family_name: str, flavor: str, shape: str | None) -> None:
    """--shape dim=512,n_layers=8: change the flavor's shape in this process (a what-if, or a
    model size between the registered flavors). Nothing on disk changes.

    Args:
        family_name: the model family (model.name).
        flavor: the flavor changed (model.flavor).
        shape: comma-separated field=value pairs of the family's model arguments; None or empty: no
            change.
    """
    if not shape:
        return
    import dataclasses

    from torchtitan_amp.models import get_family

    family = get_family(family_name)
    fields = {f.name: f.type for f in dataclasses.fields(family.args_cls)}
    changes: dict[str, Any] = {}
    for item in shape.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in fields or not value:
            raise ConfigError(f"--shape entry '{item}': expected KEY=VALUE with KEY one of {', '.join(fields)}")
        try:
            changes[key] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            raise ConfigError(f"--shape entry '{item}': '{value}' is not a number") from None
    family.flavors[flavor] = dataclasses.replace(family.flavors[flavor], **changes)


def estimate(config: JobConfig, ngpu: int | None, device: str = "cuda") -> dict[str, Any]:
    """The analytic estimate for rank 0 (the largest shard and pipeline rank 0), as a dict; device
    "cpu" for a measurement here (memory.activation_bytes: what only CPU's attention saves).

    Args:
        config: the job config (model, layout, precision, batch).
        ngpu: the world size; None: dry_run.world_size, else the product of the config's degrees.
        device: "cuda" (the default) sizes a GPU; "cpu" for a measurement here.
    """
    from torchtitan_amp.train.dry_run import resolve

    res = resolve(config, ngpu)
    est = memory.estimate(res.model_dims, res.precision, res.layout, device=device)
    d = est.to_dict()
    d.update(
        world_size=res.world_size,
        device=device,
        flavor=config.model.flavor,
        total_params=res.model_dims.total_params(),
        active_params=res.model_dims.active_params(),
        layout={
            "dp_replicate": res.dims.dp_replicate,
            "dp_shard": res.dims.dp_shard,
            "cp": res.dims.cp,
            "ep": res.dims.ep,
            "tp": res.dims.tp,
            "pp": res.dims.pp,
            "seq_len": res.layout.seq_len,
            "local_seq_len": res.layout.local_seq_len,
            "attn_mask_type": res.layout.attn_mask_type,
            "local_batch_size": res.layout.local_batch_size,
            "grad_accum": res.layout.grad_accum,
            "ac": res.layout.ac_label,
        },
        precision={
            "path": res.plan.path,
            "storage": res.precision.storage,
            "param": res.precision.param,
            "reduce": res.precision.reduce,
            "comm_hook": res.plan.comm_hook,
            "cp_reduce": res.precision.cp_reduce,
        },
        # The activation collectives context and expert parallel add (the dry run reports every
        # category).
        cp_communication={
            **memory.cp_comm(res.model_dims, res.precision, res.layout),
            **res.model_dims.ep_comm(res.precision, res.layout, memory.rank_stages(res.model_dims, res.layout)),
        },
    )
    return d


def format_estimate(d: dict[str, Any]) -> str:
    fb, fd = memory.fmt_bytes, memory.fmt_by_dtype
    lay, pr, st, acts = d["layout"], d["precision"], d["state"], d["activations"]
    ep = f" (ep {lay['ep']})" if lay.get("ep", 1) > 1 else ""
    lines = [
        f"{d['flavor']} ({d['total_params']:,} params"
        + (f", {d['active_params']:,} active" if d.get("active_params", d["total_params"]) != d["total_params"] else "")
        + f"), rank 0 of {d['world_size']}: "
        f"pp {lay['pp']} x dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} x cp {lay['cp']} x "
        f"tp {lay['tp']}{ep}; seq {lay['seq_len']} ({lay['local_seq_len']} per rank, {lay['attn_mask_type']}) "
        f"x local batch {lay['local_batch_size']}, {lay['grad_accum']} accumulation step(s), "
        f"AC {lay['ac']}" + ("; activations as this CPU saves them (--measure)" if d.get("device") == "cpu" else ""),
        f"precision: path={pr['path']} storage={pr['storage']} param={pr['param']} reduce={pr['reduce']} "
        f"comm_hook={pr['comm_hook']}" + (f" cp_reduce={pr['cp_reduce']}" if lay["cp"] > 1 else ""),
        "",
        f"  {'per rank':38s} {'bytes':>12s}  by dtype",
    ]
    rows = [
        ("parameters (as allocated)", st["params_padded"]),
        ("gradients", st["grads"]),
        ("optimizer state (AdamW)", st["optimizer"]),
        ("transient (FSDP gathers, DDP buckets)", d["transient"]),
    ]
    for name, by in rows:
        lines.append(f"  {name:38s} {fb(memory.sum_bytes(by)):>12s}  {fd(by)}")
    lines.append(f"  {'activations, AC none':38s} {fb(acts['none']):>12s}")
    lines.append(f"  {'activations, AC full':38s} {fb(acts['full']):>12s}")
    if acts["configured_mode"] not in ("none", "full"):
        lines.append(f"  {'activations, AC ' + lay['ac']:38s} {fb(acts['configured']):>12s}")
    pk = d["peak"]
    lines.append(
        f"  {'peak, AC none / AC full':38s} {fb(pk['ac_none']):>12s}  / {fb(pk['ac_full'])}"
        f"   (configured {lay['ac']}: {fb(pk['configured'])})"
    )
    for name, by in d.get("cp_communication", {}).items():
        lines.append(f"  {name + ' per step':38s} {fb(memory.sum_bytes(by)):>12s}  {fd(by)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Measurement (runs in a fresh child process, under torchrun when more than one rank)


def _status_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(m.group(1))


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    from torchtitan_amp.precision import dtype_name

    out: dict[str, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        memory.add_bytes(out, dtype_name(local.dtype), local.numel() * local.element_size())
    return out


def _warm_up(param_dtype: torch.dtype) -> None:
    """Load what the first step would load lazily (kernels, autograd and OpenMP threads, the
    cached CPU peak-FLOPs measurement) so that it is not counted as the model's memory."""
    import torch

    # Any small model loads the same kernels and threads; Llama's stands in for every family.
    from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer
    from torchtitan_amp.observability.metrics import peak_flops

    peak_flops(torch.device("cpu"), {torch.float32, param_dtype})
    model = Transformer(LlamaModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=16))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    tokens = torch.randint(0, 64, (2, 16))
    for dtype in {torch.float32, param_dtype}:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
    del model, opt, loss
    gc.collect()


def measure_child(argv: list[str], steps: int, out_path: str, shape: str | None) -> int:
    """Train `steps` steps of `argv`'s job in this process (a torchrun rank) and write each rank's
    measured bytes (parameters, gradients, optimizer state by dtype; resident-memory
    baseline, peak and end) to `out_path` as JSON on rank 0; returns the exit code.

    Args:
        argv: the job's config overrides.
        steps: training steps run before the peak is read.
        out_path: the JSON file rank 0 writes.
        shape: a --shape change of the flavor (apply_shape); None: none.
    """
    import torch
    import torch.distributed as dist

    from torchtitan_amp.train import build as train_build
    from torchtitan_amp.train.dry_run import resolve
    from torchtitan_amp.train.trainer import Trainer

    config = load_config(argv)
    apply_shape(config.model.name, config.model.flavor, shape)
    _warm_up(resolve(config, int(os.environ.get("WORLD_SIZE", "1"))).plan.param_dtype)
    marks: dict[str, int] = {}
    build_model = train_build.build_model

    def build_and_mark(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        reset_peak_rss()
        marks["baseline"] = rss_bytes()
        return build_model(*args, **kwargs)

    train_build.build_model = build_and_mark  # the window opens right before the model exists
    trainer = Trainer(config)
    with torch.random.fork_rng(devices=[]):
        batches = iter(trainer.run.dataloader)
    for _ in range(steps):
        trainer.train_step(batches)
    gc.collect()
    peak, end = peak_rss_bytes(), rss_bytes()
    params = [p for part in trainer.run.model_parts for p in part.parameters()]
    result: dict[str, Any] = {
        "rank": trainer.run.info.rank,
        "params": _by_dtype(params),
        "grads": _by_dtype(p.grad for p in params if p.grad is not None),
        "optimizer": _by_dtype(
            t for s in trainer.run.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ),
        "rss_baseline": marks["baseline"],
        "rss_peak_delta": peak - marks["baseline"],
        "rss_end_delta": end - marks["baseline"],
        "steps": steps,
    }
    trainer.run.metrics.close()
    results: list[dict[str, Any] | None] = [result]
    if dist.is_initialized():
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        dist.destroy_process_group()
    if result["rank"] == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    return 0


def measure(
    overrides: list[str], ngpu: int, steps: int, out_dir: Path, shape: str | None = None
) -> list[dict[str, Any]]:
    """Run measure_child in a fresh process (torchrun with ngpu ranks if ngpu > 1).

    Args:
        overrides: the job's config overrides.
        ngpu: the ranks (CPU processes).
        steps: training steps measured.
        out_dir: the folder of the child's JSON and log.
        shape: a --shape change of the flavor (apply_shape); None: none.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "measured.json"
    out.unlink(missing_ok=True)
    child = [
        "--measure-child",
        str(out),
        "--steps",
        str(steps),
        *(["--shape", shape] if shape else []),
        *overrides,
        "--job.dump_folder",
        str(out_dir),
    ]
    proc = subprocess.run(
        module_cmd(MODULE, ngpu, child),
        env=child_env({"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"measurement failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(out.read_text())


def format_measured(est: dict[str, Any], measured: list[dict[str, Any]]) -> tuple[str, bool]:
    fb = memory.fmt_bytes
    st = est["state"]
    expected = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"]}
    state_est = sum(memory.sum_bytes(v) for v in expected.values())
    peak_est = est["peak"]["configured"]
    ok = True
    lines = [
        "",
        f"  measured after {measured[0]['steps']} step(s) "
        f"(tensors: exact bytes; RSS: growth from just before the model is built)",
    ]
    for m in measured:
        exact = all(m[k] == v for k, v in expected.items())
        if m["rank"] == 0:
            ok &= exact
        tensors = sum(memory.sum_bytes(m[k]) for k in expected)
        lines.append(
            f"  rank {m['rank']}: params+grads+optimizer {fb(tensors)} "
            f"({'= estimate' if exact else 'estimate ' + fb(state_est) + ' (rank 0): MISMATCH'}); "
            f"RSS peak +{fb(m['rss_peak_delta'])} (estimate {fb(peak_est)}, ratio "
            f"{m['rss_peak_delta'] / peak_est:.2f}), RSS at end +{fb(m['rss_end_delta'])} "
            f"(state estimate {fb(state_est)})"
        )
        if not exact and m["rank"] == 0:
            for k, v in expected.items():
                if m[k] != v:
                    lines.append(f"    {k}: measured {m[k]} estimated {v}")
    return "\n".join(lines), ok


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other options are train.py config overrides (--section.key value).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ngpu",
        type=int,
        help="ranks (default: the product of the configured degrees, data_parallel_shard_degree -1 counting as 1)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="also build the model and train on this CPU (torchrun with --ngpu processes) and compare",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="steps of the --measure run (default %(default)s: the "
        "second runs with the optimizer state alive, the steady state)",
    )
    p.add_argument("--out", default="outputs/estimate_memory", help="dump folder of the --measure run")
    p.add_argument("--json", metavar="FILE", help="write the estimate (and measurement) as JSON")
    p.add_argument(
        "--shape",
        metavar="K=V,...",
        help="change the flavor's shape, e.g. dim=512,n_layers=8,n_heads=8 "
        "(fields of the family's args: LlamaModelArgs for llama3)",
    )
    p.add_argument("--measure-child", metavar="OUT", help=argparse.SUPPRESS)
    args, overrides = p.parse_known_args(argv)
    if args.measure_child:
        return measure_child(overrides, args.steps, args.measure_child, args.shape)
    try:
        config = load_config(overrides)
        apply_shape(config.model.name, config.model.flavor, args.shape)
        est = estimate(config, args.ngpu, "cpu" if args.measure else "cuda")
    except (ConfigError, ValueError) as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    print(format_estimate(est))
    ok = True
    if args.measure:
        start = time.perf_counter()
        measured = measure(overrides, est["world_size"], args.steps, Path(args.out).resolve(), args.shape)
        text, ok = format_measured(est, measured)
        print(text)
        print(f"  (measurement took {time.perf_counter() - start:.1f} s)")
        est["measured"] = measured
    if args.json:
        Path(args.json).write_text(json.dumps(est, indent=1) + "\n")
    return 0 if ok else 1


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
