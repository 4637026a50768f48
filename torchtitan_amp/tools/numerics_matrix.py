#!/usr/bin/env python3
"""Train the debug model on every parallel layout x precision that fits this machine and tabulate
how far each loss curve lands from the fp32 single-process reference.

    python -m torchtitan_amp.tools.numerics_matrix                      # everything up to 4 processes
    python -m torchtitan_amp.tools.numerics_matrix --max-procs 2 --steps 10 --only 'single|FSDP'
    python -m torchtitan_amp.tools.numerics_matrix --output docs/numerics_table.md
    python -m torchtitan_amp.tools.numerics_matrix --max-procs 8 --only '^(FSDP 2 x TP 2 x PP 2|HSDP 2x2 x TP 2) / '
    python -m torchtitan_amp.tools.numerics_matrix --diff BEFORE_OUT AFTER_OUT     # a refactor changed nothing?
    python -m torchtitan_amp.tools.numerics_matrix --json docs/img/numerics_matrix.json   # the figures' data

Every run sees the same data: the global batch is fixed (`--global-batch`, default 4 sequences)
and a D-way data-parallel layout runs local_batch_size = global / D (the loader deals each step's
sequences round-robin over the data-parallel ranks, so their union is the single process's batch),
with the same seed, hence the same initial weights. Differences therefore come from precision and
from reduction order only.

Layouts (processes): single (1); DDP 2, FSDP 2, TP 2, PP 2, CP 2 (2); HSDP 2x2, FSDP 2 x TP 2,
FSDP 2 x CP 2 (4); the 3-D
FSDP 2 x TP 2 x PP 2 and HSDP 2x2 x TP 2 (8: fp32 and bf16 only, and only with --max-procs 8; the
test suite's time budget leaves them out, so this tool is where they run). The mixture-of-experts
rows train debugmodel_moe instead, against their own one-process reference: MoE single (1); MoE
FSDP 2, MoE EP 2 (dp_shard 2 with expert_parallel_degree 2), MoE TP 2 (2); fp32, bf16 (routers in
fp32, the default) and bf16 + bf16 router (mixed_precision.router_dtype = bfloat16) only. The
families beside Llama train their own debugmodel on one process, against their own fp32 run:
Qwen3 single (fp32, bf16), DeepSeek-V3 single and gpt-oss single (the MoE rows' three).
Precisions: fp32 (mixed_precision.enabled = false); bf16 (param bf16, reduce fp32: the default,
realised by autocast or the FSDP policy depending on the layout); bf16 + bf16 reduce (layouts with
data parallelism); fp16 + loss scaling (GradScaler / ShardedGradScaler); pure bf16
(training.dtype = bfloat16: bf16 params, grads and AdamW state); bf16 + bf16 cp reduce
(context-parallel layouts: the K/V gradients summed over the cp ranks in bf16). Opt-in, single
process only, when --only or --preset names them: fp8 rowwise (torchao) and the emulated
block-scaled recipes (mxfp8; nvfp4 full, RHT off, SR off, 1x16 W), each on top of bf16;
`--preset blockscaled --tail N` compares their last N steps with bf16's.

Runs are grouped by process count: one torchrun launch trains all runs of that size one after
another (this file's --worker mode), paying process start-up once. A run that fails is reported in
the table and the launch is resumed with the runs after it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from torchtitan_amp.tools.common import machine, torchrun
from torchtitan_amp.tools.numerics_report import diff_main, results_json, table, tail_table
from torchtitan_amp.tools.numerics_runs import PRESETS, Result, Run, select_runs, train_args

MODULE = "torchtitan_amp.tools.numerics_matrix"  # how this tool relaunches itself under torchrun

# ---------------------------------------------------------------------------------------------
# Worker: runs inside torchrun, trains each run of the spec in turn


def worker(spec_path: str) -> int:
    import logging

    # Here, not at the top: the driver only launches, and without torch it starts in ~0.3 s.
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.train.trainer import train_in_turn

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(message)s", stream=sys.stdout, force=True)
    runs = json.loads(Path(spec_path).read_text())["runs"]
    for i, wall_s in train_in_turn([(Path(run["dump_folder"]), run["args"]) for run in runs]):
        if rank == 0:
            (Path(runs[i]["dump_folder"]) / "done.json").write_text(
                json.dumps({"wall_s": wall_s, "args": runs[i]["args"]})
            )
            print(f"[numerics_matrix] {runs[i]['name']} done in {wall_s:.1f} s", flush=True)
    process_groups.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# Driver


def read_result(run: Run, folder: Path) -> Result:
    result = Result(run)
    done = folder / "done.json"
    metrics = folder / "metrics.jsonl"
    if done.is_file() and metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            result.losses[int(row["step"])] = math.nan if row["loss"] is None else float(row["loss"])
            result.skipped_steps = int(row.get("skipped_steps") or 0)
            if row.get("val_loss") is not None:
                result.val_loss = float(row["val_loss"])
        result.wall_s = json.loads(done.read_text())["wall_s"]
        report = folder / "precision_report.json"
        if report.is_file():
            plan = json.loads(report.read_text())
            result.path = plan["path"]
            if (plan.get("router") or {}).get("routers"):
                result.router_dtype = plan["router"]["router_dtype"]
    else:
        errors = sorted(folder.glob("error_rank*.txt"))
        lines = errors[0].read_text().strip().splitlines() if errors else []
        result.error = lines[-1][:200] if lines else "did not finish (see the launch log)"
    return result


def reusable(run: Run, a: argparse.Namespace, out: Path) -> bool:
    """Whether `out` holds this run finished with exactly these training arguments (--reuse).

    Args:
        run: the run looked for.
        a: the command line (its training settings make the run's arguments).
        out: the --out folder.
    """
    done = out / run.key / "done.json"
    return done.is_file() and json.loads(done.read_text()).get("args") == train_args(run, a)


def launch(runs: list[Run], nproc: int, a: argparse.Namespace, out: Path) -> dict[str, Result]:
    """Train `runs` in one torchrun launch; if one fails, record it and relaunch the rest.

    Args:
        runs: the runs, all of `nproc` processes, trained in this order.
        nproc: the processes of the launch.
        a: the command line (training settings, --reuse, --timeout).
        out: the --out folder: one dump folder per run, the specs and launch logs.
    """
    results: dict[str, Result] = {}
    pending = [r for r in runs if not (a.reuse and reusable(r, a, out))]
    for r in runs:
        if r not in pending:
            results[r.label] = read_result(r, out / r.key)
            print(f"  {r.label}: reused from {out / r.key}", flush=True)
    attempt = 0
    while pending:
        spec = {"runs": [{"name": r.label, "dump_folder": str(out / r.key), "args": train_args(r, a)} for r in pending]}
        for r in pending:  # metrics.jsonl appends: start each run from an empty folder
            for f in (
                "metrics.jsonl",
                "done.json",
                "precision_report.json",
                *[p.name for p in (out / r.key).glob("error_rank*.txt")],
            ):
                (out / r.key / f).unlink(missing_ok=True)
        spec_path = out / f"spec_{nproc}proc_{attempt}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        print(
            f"launching {len(pending)} run(s) on {nproc} process(es): {', '.join(r.label for r in pending)}", flush=True
        )
        returncode = torchrun(
            MODULE, nproc, ["--worker", str(spec_path)], out / f"launch_{nproc}proc_{attempt}.log", timeout=a.timeout
        )
        still = []
        failed_one = False
        for r in pending:
            res = read_result(r, out / r.key)
            if not res.error:
                results[r.label] = res
                print(f"  {r.label}: final loss {res.losses[max(res.losses)]:.5f} ({res.wall_s:.1f} s)", flush=True)
            elif not failed_one:
                # The first unfinished run is the one that failed (runs go in order).
                if returncode == 0:
                    res.error = res.error or "did not finish"
                results[r.label] = res
                failed_one = True
                print(f"  {r.label}: FAILED: {res.error}", flush=True)
            else:
                still.append(r)
        pending = still
        attempt += 1
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default %(default)s)")
    p.add_argument(
        "--global-batch", type=int, default=4, help="sequences per step over all ranks (default %(default)s)"
    )
    p.add_argument("--flavor", default="debugmodel", help="model flavor (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, 2 warm-up steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--val-batches",
        type=int,
        default=8,
        help="global batches of the validation loss after the last step (0: none; default %(default)s)",
    )
    p.add_argument("--max-procs", type=int, default=4, help="skip layouts needing more processes (default %(default)s)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named selection instead of --only: " + "; ".join(f"{k}: {v['help']}" for k, v in PRESETS.items()),
    )
    p.add_argument(
        "--tail",
        type=int,
        default=0,
        help="also tabulate each run's mean loss over its last N steps "
        "against single bf16 (--preset: a tenth of --steps unless given)",
    )
    p.add_argument(
        "--only",
        metavar="REGEX",
        help="only runs whose 'layout / precision' label matches "
        "(the fp32 single-process reference of each model it selects always runs)",
    )
    p.add_argument(
        "--out", default="outputs/numerics_matrix", help="dump folders and launch logs (default %(default)s)"
    )
    p.add_argument("--output", metavar="FILE", help="also write the markdown (table + command) to FILE")
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write every run's per-step losses as JSON (the data "
        "of docs/numerics.md's figures: python -m torchtitan_amp.tools.numerics_figures)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep the runs --out already holds finished with the "
        "same training arguments (an interrupted matrix resumes; wall times are the original runs')",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per torchrun launch")
    p.add_argument(
        "--diff",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="train nothing: compare two --out folders run by run, step by step, bit for bit "
        "(exit 1 if any run differs)",
    )
    a = p.parse_args(argv)
    if a.preset:
        if a.only:
            p.error("--preset and --only both select runs: give one")
        a.only = PRESETS[a.preset]["only"]
        a.tail = a.tail or max(1, a.steps // 10)
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a.worker)
    if a.diff:
        return diff_main(*a.diff)
    runs, notes = select_runs(a.max_procs, a.only)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict[str, Result] = {}
    for nproc in sorted({r.layout.nproc for r in runs}):
        results.update(launch([r for r in runs if r.layout.nproc == nproc], nproc, a, out))
    elapsed = time.perf_counter() - start
    command = shlex.join(["python", "-m", MODULE, *argv])
    models = dict.fromkeys(train_args(r, a)[train_args(r, a).index("--model.flavor") + 1] for r in runs)
    settings = (
        f"{' and '.join(models) or a.flavor}, seq_len {a.seq_len}, global batch {a.global_batch} sequences, "
        f"{a.steps} steps, lr {a.lr:g} (2 warm-up steps), seed {a.seed}; {machine()}; "
        f"{datetime.date.today().isoformat()}, {elapsed / 60:.1f} min."
    )
    md = [
        f"Command: `{command}`",
        "",
        settings,
        "",
        table(results, runs, a.steps),
    ]
    if a.tail:
        md += ["", tail_table(results, runs, a.tail, "single / bf16")]
    if notes:
        md += ["", *[f"- {n}" for n in notes]]
    text = "\n".join(md) + "\n"
    print()
    print(text)
    if a.output:
        Path(a.output).write_text(text)
    if a.json:
        data = results_json(results, runs, {"command": command, "settings": settings, "steps": a.steps, "notes": notes})
        Path(a.json).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return 1 if any(r.error for r in results.values()) else 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
