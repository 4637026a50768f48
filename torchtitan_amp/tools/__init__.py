"""Command-line tools beside training, each a module with `main(argv) -> exit code` and a console
command (pyproject.toml):

    torchtitan-amp-plan-layout       python -m torchtitan_amp.tools.plan_layout      rank layouts before having the GPUs
    torchtitan-amp-estimate-memory   python -m torchtitan_amp.tools.estimate_memory  per-rank memory, analytic or measured
    torchtitan-amp-numerics-matrix   python -m torchtitan_amp.tools.numerics_matrix  layout x precision loss table
    torchtitan-amp-evaluate          python -m torchtitan_amp.tools.evaluate         a checkpoint's validation loss, any layout
    torchtitan-amp-plot              python -m torchtitan_amp.tools.plot             runs' loss, grad norm, lr, throughput, MFU (PNG)
    torchtitan-amp-numerics-figures  python -m torchtitan_amp.tools.numerics_figures docs/numerics.md's figures from saved JSON
    torchtitan-amp-generate          python -m torchtitan_amp.tools.generate         text from a checkpoint, an export or an HF folder

`python -m` works from a checkout without installing (run it from the repository root).
memory_table.py is no command: the dry-run memory table benchmarks/torchtitan_memory.py prints.
"""
