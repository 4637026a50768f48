#!/usr/bin/env python3
"""Framework overhead: torchtitan_amp's Trainer.train_step vs a minimal hand-written PyTorch loop,
same model, same precision, same batch, same optimizer, in one process.

    python -m benchmarks.overhead                       # debug model, fp32 and bf16
    python -m benchmarks.overhead --models debug,large --steps 10

The hand-written loop is nanoGPT's: `torch.autocast` around forward + loss (bf16) or nothing
(fp32), cross-entropy on fp32 logits, backward, `clip_grad_norm_`, foreach AdamW, zero_grad. The
Trainer step adds what the framework does per step: the data loader (packed pydoc text, the
loop gets pre-made random tokens), the precision plan's fp32 islands and contexts, the global grad
norm, the loss scaler interface and the LR schedule. Steps alternate between the two (T H, H T,
T H, ...) after warm-up so that load changes on a shared machine hit both alike and neither always
runs first. The overhead is the ratio of step times: of the medians, and of the best steps (the
step least disturbed by other processes: the better estimate on a busy machine).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import shlex
import sys
import time
from pathlib import Path

from benchmarks._common import CPU_MODELS, SHAPES, emit, header, load_average, md_table, num_params, use_model


def hand_written(args, precision: str, seq: int, batch: int, lr: float):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    from torchtitan_amp.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else \
        (lambda: torch.autocast("cpu", enabled=False))

    def step() -> float:
        with ctx():
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure(model_name: str, precision: str, steps: int, warmup: int, out: Path) -> dict:
    import torch

    from torchtitan_amp.config import load_config
    from torchtitan_amp.trainer import Trainer

    seq, batch = SHAPES[model_name]
    prec = ["--mixed_precision.enabled", "false"] if precision == "fp32" else ["--mixed_precision.param_dtype", "bfloat16"]
    config = load_config([*use_model(model_name), "--training.seq_len", str(seq), "--training.local_batch_size",
                          str(batch), "--training.steps", "1000", "--lr_scheduler.warmup_steps", "2",
                          "--job.dump_folder", str(out / f"{model_name}_{precision}"), *prec])
    trainer = Trainer(config)
    with torch.random.fork_rng(devices=[]):
        batches = iter(trainer.dataloader)
    hand = hand_written(trainer.model_args, precision, seq, batch, config.optimizer.lr)
    for _ in range(warmup):
        trainer.train_step(batches)
        hand()
    t_times, h_times = [], []

    def timed(fn, times: list[float]) -> None:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)

    for i in range(steps):
        # Alternate which loop goes first, so that neither always inherits the other's freed memory.
        pair = [(lambda: trainer.train_step(batches), t_times), (hand, h_times)]
        for fn, times in (pair if i % 2 == 0 else pair[::-1]):
            timed(fn, times)
    trainer.metrics.close()
    del trainer
    gc.collect()
    return {"model": model_name, "precision": precision, "trainer": t_times, "hand": h_times}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="debug", help=f"comma-separated, from {', '.join(CPU_MODELS)}")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each loop")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="outputs/bench_overhead")
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    text = header("Framework overhead (CPU, one process)")
    rows = []
    for model in a.models.split(","):
        for precision in a.precisions.split(","):
            r = measure(model, precision, a.steps, a.warmup, Path(a.out).resolve())
            t, h = statistics.median(r["trainer"]), statistics.median(r["hand"])
            tmin, hmin = min(r["trainer"]), min(r["hand"])
            rows.append([model, precision, f"{h * 1e3:,.1f}", f"{t * 1e3:,.1f}", f"{t / h:.3f}",
                         f"{hmin * 1e3:,.1f}", f"{tmin * 1e3:,.1f}", f"{tmin / hmin:.3f}"])
            print(f"{model} {precision}: hand {h * 1e3:.1f} ms, trainer {t * 1e3:.1f} ms", flush=True)
    seqs = "; ".join(f"{m}: {num_params(m) / 1e6:.1f}M params, seq {SHAPES[m][0]} x batch {SHAPES[m][1]}"
                     for m in a.models.split(","))
    text += (f"load average at end: {load_average()}; {torch.get_num_threads()} threads; median of {a.steps} "
             f"alternating steps after {a.warmup} warm-up steps each; {seqs}\n"
             f"command: python -m benchmarks.overhead {shlex.join(argv)}\n\n")
    text += md_table(["model", "precision", "hand-written loop ms (median)", "Trainer.train_step ms (median)",
                      "ratio of medians", "hand-written ms (best)", "Trainer ms (best)", "ratio of bests"],
                     rows) + "\n"
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
