#!/usr/bin/env python3
"""Step time of each activation-checkpointing mode on CPU, one process, fp32, side by side: no AC,
op-level SAC with torchtitan's matmul rule (per_op_sac_save_mm = "alternate"), op-level SAC
keeping every matmul output ("all"), full AC; with the analytic bytes each keeps per token and
layer (torchtitan_amp.memory), so that a user can trade memory for speed.

    python -m benchmarks.ac_speed                 # dim 512, 2 layers, seq 256 x 2: ~1 min on 2 cores
    python -m benchmarks.ac_speed --model large --layers 2   # dim 1024

The modes run round-robin, one forward + backward each per round, and each step is timed in CPU
time of this process (time.process_time) on one torch thread by default: on a shared machine the
time spent waiting for a core is not counted, which wall time would add at random. The median over
rounds is reported, and the ratio to no AC.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from benchmarks._common import CPU_MODELS, emit, header, md_table, model_args, summarize

MODES: dict[str, list[str]] = {
    "no AC": [],
    "op SAC, alternate mm (default)": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    "op SAC, all mm": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--activation_checkpoint.per_op_sac_save_mm",
        "all",
    ],
    "full AC": ["--activation_checkpoint.mode", "full"],
}


def _build(name: str, ac_args: list[str], seq_len: int, layers: int):  # type: ignore[no-untyped-def]
    """The model under this AC mode, and its activation bytes per token per layer."""
    import torch

    from torchtitan_amp import memory
    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed import activation_checkpoint
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.models import get_family
    from torchtitan_amp.precision import PrecisionPlan, memory_spec

    family = get_family("llama3")
    config = load_config(["--model.flavor", CPU_MODELS[name]["flavor"], "--mixed_precision.enabled", "false", *ac_args])
    args = dataclasses.replace(model_args(name, seq_len=seq_len), n_layers=layers)
    torch.manual_seed(0)
    model = family.build_model(args)
    model.init_weights()
    ac = config.activation_checkpoint
    if ac.mode != "none":
        activation_checkpoint.apply_ac(model, ac, family.ac_regions)
    layout = memory.Layout(
        seq_len=seq_len, ac_mode=ac.mode, ac_option=ac.selective_ac_option, op_sac_save_mm=ac.per_op_sac_save_mm
    )
    prec = memory_spec.from_plan(PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu"), family.norm_cls)
    terms = family.memory_dims(args).activation_terms(prec, layout)
    kept = {"none": terms.layer, "full": terms.layer_checkpointed, "selective": terms.layer_op_sac}[ac.mode]
    return model, kept


def _step(model, tokens) -> None:  # type: ignore[no-untyped-def]
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="medium", choices=list(CPU_MODELS))
    p.add_argument("--layers", type=int, default=2, help="blocks (the flavor's shape otherwise)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds (one step of every mode each)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steadier on a shared machine, where a second thread waits for a core)",
    )
    p.add_argument("--output", metavar="FILE", help="also write the markdown report here")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    seq_len, batch = a.seq_len, a.batch
    built = {mode: _build(a.model, ac, seq_len, a.layers) for mode, ac in MODES.items()}
    tokens = torch.randint(0, 258, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(a.rounds + 1):  # round 0 warms up
        for mode, (model, _) in built.items():
            start = time.process_time()
            _step(model, tokens)
            if r:
                times[mode].append(time.process_time() - start)
    base = summarize(times["no AC"])
    rows = [
        [mode, f"{summarize(times[mode]):.3f}", f"{summarize(times[mode]) / base:.2f}", f"{kept / 1024:.1f}"]
        for mode, (_, kept) in built.items()
    ]
    text = header("Step time by activation-checkpointing mode (CPU, one process, fp32)")
    shape = {**CPU_MODELS[a.model].get("replace", {}), "n_layers": a.layers}
    text += (
        f"\nmodel {a.model} {shape}, seq {seq_len}, batch {batch}, median of {a.rounds} rounds\n"
        f"command: python -m benchmarks.ac_speed {' '.join(argv)}\n\n"
    )
    text += md_table(["mode", "step CPU s", "vs no AC", "KiB kept per token per layer"], rows) + "\n"
    emit(text, a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
