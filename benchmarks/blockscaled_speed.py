#!/usr/bin/env python3
"""What the block-scaled emulation costs: forward + backward of one Linear (M x K x N) as a plain
F.linear in fp32 and bf16, and as the emulated MXFP8, NVFP4 and full NVFP4 recipe (2-D weights,
RHT, SR) of torchtitan_amp.precision.lowbit.linear, side by side on this CPU.

    python -m benchmarks.blockscaled_speed                  # 1024^3, 6 rounds: ~1 min on 2 cores
    python -m benchmarks.blockscaled_speed --size 2048 --threads 2

The variants run round-robin, one forward + backward each per round (the first round is a warm-up
and dropped), timed in CPU time of this process (time.process_time) on one torch thread by
default, so that waiting for a core on a shared machine is not counted. Reported: the median time
of each, and its median ratio to the plain linear of the same input dtype and to bf16's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks._common import emit, header, md_table


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=1024, help="M = K = N of the Linear (tokens, in, out)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None, help="also write the report to this file")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from torchtitan_amp.precision.lowbit import formats as bs
    from torchtitan_amp.precision.lowbit import linear as bl

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = args.size
    gen = torch.Generator().manual_seed(0)
    recipes = {
        "linear": None,
        "mxfp8": bs.BlockScaledRecipe("mxfp8"),
        "nvfp4": bs.BlockScaledRecipe("nvfp4"),
        "nvfp4 full (2-D W, RHT, SR)": bs.BlockScaledRecipe.nvfp4_full(),
    }
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    inputs = {
        d: (torch.randn(n, n, dtype=t, requires_grad=True), (torch.randn(n, n, dtype=t) / n**0.5).requires_grad_(True))
        for d, t in dtypes.items()
    }
    times: dict[tuple[str, str], list[float]] = {(r, d): [] for r in recipes for d in dtypes}
    for rnd in range(args.rounds + 1):
        for d in dtypes:
            for name, recipe in recipes.items():
                x, w = inputs[d]
                t0 = time.process_time()
                y = F.linear(x, w) if recipe is None else bl.block_scaled_linear(x, w, None, recipe, gen)
                y.float().sum().backward()
                if rnd:
                    times[(name, d)].append(time.process_time() - t0)
    rows = []
    for name in recipes:
        for d in dtypes:
            own = [a / b for a, b in zip(times[(name, d)], times[("linear", d)])]
            vs_bf16 = [a / b for a, b in zip(times[(name, d)], times[("linear", "bf16")])]
            rows.append(
                [
                    name,
                    d,
                    f"{statistics.median(times[(name, d)]) * 1e3:.0f}",
                    f"{statistics.median(own):.1f}x",
                    f"{statistics.median(vs_bf16):.1f}x",
                ]
            )
    text = (
        header(
            f"Block-scaled emulation vs F.linear, {n}x{n}x{n} forward + backward, "
            f"{args.threads} thread(s), median of {args.rounds} rounds"
        )
        + "\n"
        + md_table(["variant", "inputs", "ms", "vs linear (same dtype)", "vs bf16 linear"], rows)
    )
    emit(text, args.output)


if __name__ == "__main__":
    main()
