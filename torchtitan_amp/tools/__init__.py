"""Command-line tools beside training, each a module with `main(argv) -> exit code` and a console
command (pyproject.toml); the command `torchtitan-amp-NAME` is also
`python -m torchtitan_amp.tools.NAME` (dashes as underscores):

    torchtitan-amp-plan-layout       rank layouts before having the GPUs
    torchtitan-amp-estimate-memory   per-rank memory, analytic or measured
    torchtitan-amp-numerics-matrix   layout x precision loss table
    torchtitan-amp-evaluate          a checkpoint's validation loss, any layout
    torchtitan-amp-plot              runs' loss, grad norm, lr, throughput, MFU (PNG)
    torchtitan-amp-numerics-figures  docs/numerics.md's figures from saved JSON
    torchtitan-amp-generate          text from a checkpoint, an export or an HF folder

`python -m` works from a checkout without installing (run it from the repository root).
memory_table.py is no command: the dry-run memory table benchmarks/torchtitan_memory.py prints;
numerics_runs.py and numerics_report.py neither: the numerics matrix's runs, and its tables, JSON and
--diff.
"""
