#!/usr/bin/env python3
"""Per-format quantization error of real GEMM operands: the debug model trained in bf16 for some
steps, then one more batch run forward and backward in fp32 with hooks on every Linear of the
transformer blocks, capturing its input x, weight W and output gradient dy; each operand, laid out
as the GEMM that reads it (quantized along that GEMM's reduction dim), quantize-dequantized in each
format of torchtitan_amp/precision/lowbit/quant_error.py.

    OMP_NUM_THREADS=1 python -m benchmarks.blockscaled_error                 # 100 bf16 steps first
    python -m benchmarks.blockscaled_error --steps 10 --flavor debugmodel_tiny --json /tmp/err.json

Roles: x (forward, M x K along K), W (forward, N x K along K), dy (dgrad, M x N along N), dy^T and
x^T (wgrad, along M, the tokens: where the recipe's RHT applies). Per role and format the pooled
relative L2 error over all the captured Linears (sqrt of summed squared errors over summed
squares), the worst single Linear's, and the fractions of elements flushed to zero and of scaling
groups with a clipped element.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks._common import emit, header, md_table

# Which formats apply to which role (the recipes' choices and their alternatives).
ALL = ("bf16", "fp8 tensorwise", "fp8 rowwise", "mxfp8 floor", "mxfp8 rceil", "nvfp4 1x16")
ROLES = {  # role -> (is a gradient, formats beyond ALL)
    "x (fwd)": (False, ()),
    "W (fwd)": (False, ("nvfp4 16x16",)),
    "dy (dgrad)": (True, ("nvfp4 1x16 + SR",)),
    "dy^T (wgrad)": (True, ("nvfp4 1x16 + SR", "nvfp4 1x16 + RHT", "nvfp4 1x16 + RHT + SR")),
    "x^T (wgrad)": (False, ("nvfp4 1x16 + RHT",)),
}


def capture(steps: int, flavor: str, seq_len: int, batch: int, seed: int, folder: Path):  # type: ignore[no-untyped-def]
    """{linear name: {role: 2-D fp32 tensor}} after `steps` bf16 steps, from one fp32 forward and
    backward of the next batch."""
    import torch
    from torch import nn

    from torchtitan_amp.config import load_config
    from torchtitan_amp.models.loss import loss_fn
    from torchtitan_amp.train import trainer as trainer_module

    config = load_config(
        [
            "--model.flavor",
            flavor,
            "--training.seq_len",
            str(seq_len),
            "--training.local_batch_size",
            str(batch),
            "--training.steps",
            str(steps),
            "--training.seed",
            str(seed),
            "--training.gc_freq",
            "0",
            "--lr_scheduler.warmup_steps",
            "2",
            "--optimizer.lr",
            "3e-3",
            "--mixed_precision.param_dtype",
            "bfloat16",
            "--mixed_precision.enabled",
            "true",
            "--metrics.log_freq",
            str(max(steps, 1)),
            "--job.dump_folder",
            str(folder),
        ]
    )
    trainer = trainer_module.Trainer(config)
    trainer.train()
    model = trainer.run.model
    captured: dict[str, dict[str, torch.Tensor]] = {}

    def hook(name: str):  # type: ignore[no-untyped-def]
        def forward(module: nn.Linear, args, out):  # type: ignore[no-untyped-def]
            x = args[0].detach().reshape(-1, module.in_features).float()
            captured[name] = {"x (fwd)": x, "W (fwd)": module.weight.detach().float(), "x^T (wgrad)": x.t()}

            def grad(g: torch.Tensor) -> None:
                dy = g.detach().reshape(-1, module.out_features).float()
                captured[name].update({"dy (dgrad)": dy, "dy^T (wgrad)": dy.t()})

            out.register_hook(grad)

        return forward

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith("layers.")
    ]
    inputs, labels = next(trainer.new_batches())
    inputs, labels, extra = trainer.run.model_inputs(inputs, labels)
    model.zero_grad(set_to_none=True)
    loss_fn(model(inputs, **extra), labels).backward()  # fp32: no autocast, the reference operands
    for h in handles:
        h.remove()
    return captured


def measure(captured, seed: int) -> dict[str, dict[str, dict[str, float]]]:  # type: ignore[no-untyped-def]
    """{role: {format: {rel_l2, worst_rel_l2, worst_module, max_err, flushed, saturated}}}."""
    from torchtitan_amp.precision.lowbit.quant_error import QuantError, quant_error

    out: dict[str, dict[str, dict[str, float]]] = {}
    for role, (grad, extra) in ROLES.items():
        out[role] = {}
        for fmt in (*ALL, *extra):
            pooled, worst, worst_name = QuantError(), -1.0, ""
            for name, tensors in captured.items():
                e = quant_error(tensors[role], fmt, grad=grad, seed=seed)
                pooled = pooled.merge(e)
                if e.rel_l2 > worst:
                    worst, worst_name = e.rel_l2, name
            out[role][fmt] = {
                "rel_l2": pooled.rel_l2,
                "worst_rel_l2": worst,
                "worst_module": worst_name,
                "max_err": pooled.max_err,
                "flushed": pooled.flushed_frac,
                "saturated": pooled.saturated_frac,
            }
    return out


def tables(result: dict[str, dict[str, dict[str, float]]]) -> str:
    formats = list(dict.fromkeys(f for role in result.values() for f in role))
    roles = list(result)

    def cells(fmt: str, cell) -> list[str]:  # type: ignore[no-untyped-def]
        return [cell(result[r][fmt]) if fmt in result[r] else "-" for r in roles]

    err = md_table(
        ["format", *roles], [[f, *cells(f, lambda m: f"{m['rel_l2']:.2e} ({m['worst_rel_l2']:.2e})")] for f in formats]
    )
    pct = md_table(
        ["format", *roles],
        [[f, *cells(f, lambda m: f"{100 * m['flushed']:.2f} / {100 * m['saturated']:.1f}")] for f in formats],
    )
    return (
        "Relative L2 error, pooled over the Linears (worst Linear):\n\n"
        + err
        + "\n\n% of nonzero elements flushed to zero / % of scaling groups with a clipped element:\n\n"
        + pct
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps", type=int, default=100, help="bf16 training steps before the capture (default %(default)s)"
    )
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="training.seed; also seeds SR and the RHT signs")
    p.add_argument("--json", metavar="FILE", help="also write the measures as JSON")
    p.add_argument("--output", default=None, help="also write the report to this file")
    args = p.parse_args()

    import torch

    import torchtitan_amp.train.build as build

    torch.set_num_threads(1)
    build.peak_flops = lambda device, dtype: 1e12  # MFU is not reported here: skip measuring it
    with tempfile.TemporaryDirectory() as tmp:
        captured = capture(args.steps, args.flavor, args.seq_len, args.batch, args.seed, Path(tmp))
    result = measure(captured, args.seed)
    title = (
        f"Quantization error of the {args.flavor}'s GEMM operands after {args.steps} bf16 steps "
        f"(seq_len {args.seq_len}, batch {args.batch}, seed {args.seed}; {len(captured)} Linears)"
    )
    emit(header(title) + "\n" + tables(result), args.output)
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "roles": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
