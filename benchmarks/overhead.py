#!/usr/bin/env python3
"""Framework overhead: torchtitan_amp's Trainer step vs a minimal hand-written PyTorch loop, same
model, same precision, same batch per rank, same optimizer, in one process or on 2 ranks.

    python -m benchmarks.overhead                                  # debug model, one process, fp32 and bf16
    python -m benchmarks.overhead --models large --layouts ddp2,fsdp2,tp2 --steps 5 --warmup 1

The hand-written loop is nanoGPT's: `torch.autocast` around forward + loss (bf16) or nothing
(fp32), cross-entropy on fp32 logits, backward outside autocast, `clip_grad_norm_`, fused AdamW,
zero_grad, `loss.item()`. On 2 ranks it is what a user writes with torch's own wrappers and their
defaults: `ddp2` wraps the model in `DistributedDataParallel` (25 MiB buckets, fp32 all-reduce;
bf16 by autocast as above), `fsdp2` applies `fully_shard` to every block and the root (bf16 by a
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, no autocast), `tp2` applies the plan of
torch's tensor-parallel tutorial (`parallelize_module`: column/row-wise Linears, sequence-parallel
norms, `loss_parallel`; both ranks see the same batch; bf16 by autocast). The Trainer step is
what `Trainer.train` does per step, logging every step (`metrics.log_freq 1`: the loss all-reduce
and the metrics line, the counterpart of the loop's `.item()`): the data loader (packed pydoc text;
the loop gets pre-made random tokens), the precision plan's fp32 islands and contexts (on FSDP:
each block's norms in one fp32 group, the embeddings and final norm in another), the global grad
norm and its finiteness check, the loss-scaler interface, the LR schedule, and under TP the
one all-reduce of the norms' Partial gradients (precision.PartialGradReducer).

Steps alternate between the two (T H, H T, T H, ...) after warm-up so that load changes on a
shared machine hit both alike and neither always runs first; on 2 ranks every timed step starts
and ends at a barrier, so it is the slowest rank's step. The overhead is the ratio of step times:
of the medians, and of the best steps (the step least disturbed by other processes: the better
estimate on a busy machine). A ratio below 1 means the Trainer was faster.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks._common import CPU_MODELS, SHAPES, emit, header, load_average, md_table, num_params, run_jobs, use_model

# layout -> (processes, Trainer overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
}
HAND_LABEL = {
    "single": "plain module",
    "ddp2": "DistributedDataParallel (defaults)",
    "fsdp2": "fully_shard per block + root",
    "tp2": "parallelize_module, torch's TP tutorial plan (sequence + loss parallel)",
}
PRECISION_ARGS = {
    "fp32": ["--mixed_precision.enabled", "false"],
    "bf16": ["--mixed_precision.enabled", "true", "--mixed_precision.param_dtype", "bfloat16"],
}


def _wrap(model, layout: str, precision: str):  # type: ignore[no-untyped-def]
    """The model as a user of torch's own data-parallel wrappers would hold it, with their defaults."""
    import torch
    import torch.distributed as dist

    if layout == "ddp2":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16"
            else MixedPrecisionPolicy()
        )
        for block in model.layers.children():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    if layout == "tp2":
        _tensor_parallel(model)
    return model


def _tensor_parallel(model) -> None:  # type: ignore[no-untyped-def]
    """The plan of torch's tensor-parallel tutorial for a Llama model: Megatron column/row
    splits, norms and residual stream sharded along the sequence, logits left sharded for
    `loss_parallel`. No precision handling: bf16 is the loop's autocast."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers.children():
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def hand_written(args, layout: str, precision: str, seq: int, batch: int, lr: float) -> Callable[[], float]:  # type: ignore[no-untyped-def]
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from torchtitan_amp.models.llama3.model import Transformer

    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model = _wrap(model, layout, precision)
    # The kernel the Trainer's optimizer.implementation = "auto" picks on CPU and CUDA.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    # Data-parallel ranks see different sequences; tensor-parallel ranks the same ones.
    data_rank = dist.get_rank() if dist.is_initialized() and layout != "tp2" else 0
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(data_rank))
    x, y = tokens[:, :-1], tokens[:, 1:]
    # FSDP's policy casts inside the model; autocast is the other layouts' bf16.
    autocast = precision == "bf16" and layout != "fsdp2"
    sharded_loss = loss_parallel if layout == "tp2" else contextlib.nullcontext

    def step() -> float:
        with sharded_loss():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def trainer_step(trainer, batches) -> Callable[[], None]:  # type: ignore[no-untyped-def]
    """One step as Trainer.train runs it, without checkpointing and validation (off here)."""
    trainer.run.metrics.start_run(trainer.step, trainer.config.training.steps)

    def step() -> None:
        trainer.step += 1
        lr = trainer.run.lr_scheduler.get_last_lr()[0]
        loss, grad_norm, _ = trainer.train_step(batches)
        if trainer.run.metrics.should_log(trainer.step):
            trainer._log(loss, grad_norm, lr)

    return step


def measure(job: dict) -> dict:
    import torch
    import torch.distributed as dist

    from torchtitan_amp.config import load_config
    from torchtitan_amp.train.trainer import Trainer

    config = load_config([*use_model(job["model"]), *job["args"]])
    trainer = Trainer(config)
    with torch.random.fork_rng(devices=[]):
        batches = iter(trainer.run.dataloader)
    t_step = trainer_step(trainer, batches)
    hand = hand_written(
        trainer.run.job.model_args, job["layout"], job["precision"], job["seq"], job["batch"], config.optimizer.lr
    )
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    for _ in range(job["warmup"]):
        t_step()
        hand()
    t_times: list[float] = []
    h_times: list[float] = []

    def timed(fn: Callable[[], object], times: list[float]) -> None:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)

    for i in range(job["steps"]):
        # Alternate which loop goes first, so that neither always inherits the other's freed memory.
        pair = [(t_step, t_times), (hand, h_times)]
        for fn, times in pair if i % 2 == 0 else pair[::-1]:
            timed(fn, times)
    result = {k: job[k] for k in ("model", "layout", "precision", "seq", "batch", "steps", "warmup")}
    result.update(
        trainer=t_times, hand=h_times, threads=torch.get_num_threads(), path=trainer.run.plan.path, load=load_average()
    )
    trainer.run.metrics.close()
    del trainer, hand, t_step
    gc.collect()
    return result


def worker(spec_path: str, out_path: str) -> int:
    import logging

    import torch.distributed as dist

    from torchtitan_amp.distributed import process_groups

    logging.basicConfig(level=logging.WARNING)
    results = [measure(job) for job in json.loads(Path(spec_path).read_text())]
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    process_groups.shutdown()
    return 0


def jobs_for(layout: str, models: list[str], precisions: list[str], a: argparse.Namespace, out: Path) -> list[dict]:
    jobs = []
    for model in models:
        seq, batch = a.seq_len or SHAPES[model][0], a.batch or SHAPES[model][1]
        for precision in precisions:
            jobs.append(
                {
                    "model": model,
                    "layout": layout,
                    "precision": precision,
                    "seq": seq,
                    "batch": batch,
                    "steps": a.steps,
                    "warmup": a.warmup,
                    "args": [
                        "--training.seq_len",
                        str(seq),
                        "--training.local_batch_size",
                        str(batch),
                        "--training.steps",
                        "1000",
                        "--lr_scheduler.warmup_steps",
                        "2",
                        "--metrics.log_freq",
                        "1",
                        "--job.dump_folder",
                        str(out / f"{model}_{layout}_{precision}"),
                        *LAYOUTS[layout][1],
                        *PRECISION_ARGS[precision],
                        *a.trainer_args,
                    ],
                }
            )
    return jobs


def run_layouts(layouts: list[str], jobs: dict[str, list[dict]], out: Path) -> Iterator[dict]:
    """One process in this one (both cores for intra-op threads, as a user's single-process run);
    the 2-rank layouts all in one torchrun launch (1 thread each; a fresh Trainer and hand-written
    model per job, as numerics_matrix's launches), so that process start-up is paid once. Results
    come in the order of `layouts`."""
    order = {layout: i for i, layout in enumerate(layouts)}
    for nproc in sorted({LAYOUTS[layout][0] for layout in layouts}):
        group = [job for layout in layouts if LAYOUTS[layout][0] == nproc for job in jobs[layout]]
        if nproc == 1:
            yield from (measure(job) for job in group)
        else:
            yield from sorted(
                run_jobs(__spec__.name, nproc, group, out, f"{nproc}ranks"), key=lambda r: order[r["layout"]]
            )


def row(r: dict) -> list[str]:
    t, h = statistics.median(r["trainer"]), statistics.median(r["hand"])
    tmin, hmin = min(r["trainer"]), min(r["hand"])
    return [
        r["model"],
        r["layout"],
        r["precision"],
        HAND_LABEL[r["layout"]],
        f"{h * 1e3:,.1f}",
        f"{t * 1e3:,.1f}",
        f"{h / t:.3f}",
        f"{hmin * 1e3:,.1f}",
        f"{tmin * 1e3:,.1f}",
        f"{hmin / tmin:.3f}",
        r["load"],
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--models", default="debug", help=f"comma-separated, from {', '.join(CPU_MODELS)}")
    p.add_argument("--layouts", default="single", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each loop")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: the model's default)")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank (0: the model's default)")
    p.add_argument(
        "--trainer-args",
        default="",
        help="extra Trainer overrides, e.g. '--parallelism.ddp_bucket_cap_mb 100' (one string, split like a shell)",
    )
    p.add_argument("--out", default="outputs/bench_overhead")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    a.trainer_args = shlex.split(a.trainer_args)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    unknown = [name for name in a.layouts.split(",") if name not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    models, out = a.models.split(","), Path(a.out).resolve()
    text = header("Framework overhead (CPU)")
    start = time.perf_counter()
    rows = []
    layouts = a.layouts.split(",")
    jobs = {layout: jobs_for(layout, models, a.precisions.split(","), a, out) for layout in layouts}
    for r in run_layouts(layouts, jobs, out):
        rows.append(row(r))
        print(
            f"{r['model']} {r['layout']} {r['precision']}: hand {statistics.median(r['hand']) * 1e3:.1f} ms, "
            f"trainer {statistics.median(r['trainer']) * 1e3:.1f} ms (load {r['load']})",
            flush=True,
        )
    shapes = "; ".join(
        f"{m}: {num_params(m) / 1e6:.1f}M params, seq {a.seq_len or SHAPES[m][0]} x "
        f"{a.batch or SHAPES[m][1]} sequences per rank"
        for m in models
    )
    text += (
        f"load average at end: {load_average()}; took {(time.perf_counter() - start) / 60:.1f} min; "
        f"{torch.get_num_threads()} threads in one process, 1 per rank on 2; median of {a.steps} "
        f"alternating steps after {a.warmup} warm-up steps each; {shapes}\n"
        f"command: python -m benchmarks.overhead {shlex.join(argv)}\n\n"
    )
    text += (
        md_table(
            [
                "model",
                "layout",
                "precision",
                "hand-written loop",
                "hand ms (median)",
                "Trainer ms (median)",
                "hand / Trainer (medians)",
                "hand ms (best)",
                "Trainer ms (best)",
                "hand / Trainer (bests)",
                "load (1/5/15 min) after",
            ],
            rows,
        )
        + "\n"
    )
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
