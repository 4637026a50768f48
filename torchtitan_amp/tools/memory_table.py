"""Memory per GPU of a layout by the dry run against a published measurement, as a markdown table
(benchmarks/torchtitan_memory.py holds torchtitan's published rows and prints the table). Ours is
the dry run's *allocated* peak of the configured AC mode (train/dry_run.py; tensors alive at the
peak, no allocator cache or fragmentation), for a CUDA target, the largest over the layout's pp
ranks (one dry run per pp coordinate)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
VOCAB = 128256  # Llama 3's vocabulary: every row sizes it


@dataclass(frozen=True)
class Row:
    """One published measurement and the dry run of the same layout."""

    label: str  # the layout, as the published table states it
    theirs_gib: float  # their measured GiB per GPU
    config_file: str  # the job's TOML
    world: int
    overrides: tuple[str, ...]
    features: str  # what their run had beyond the layout (compile, Float8), and ours

    def args(self, tmp: str) -> list[str]:
        return [
            "--job.config_file",
            self.config_file,
            "--job.dump_folder",
            tmp,
            "--dry_run.vocab_size",
            str(VOCAB),
            "--dry_run.device",
            "cuda",
            *self.overrides,
        ]


def pp_ranks(world: int, pp: int) -> list[int]:
    """One rank per pp coordinate: pp is the mesh's outermost dimension."""
    return [k * (world // pp) for k in range(pp)]


def dry_run_peak(row: Row, tmp: str) -> float:
    """The row's allocated peak in GiB (configured AC mode), the largest over its pp ranks."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import dry_run

    config = load_config(row.args(tmp))
    peak = 0
    for k, rank in enumerate(pp_ranks(row.world, config.parallelism.pipeline_parallel_degree)):
        report = dry_run.run(config, world_size=row.world, rank=rank, write=False)
        if report["coordinates"]["pp"] != k:
            raise RuntimeError(f"rank {rank} of {row.world} is at pp {report['coordinates']['pp']}, not {k}")
        peak = max(peak, report["memory"]["peak_estimate"]["configured"])
    return peak / GIB


def build_table(measured: list[tuple[Row, float]]) -> str:
    """The markdown comparison table: one line per row, ratio = ours / theirs (bold above 1)."""
    lines = [
        "| torchtitan row | their run / ours | theirs GiB (max reserved) | ours GiB (allocated) | ratio |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row, ours in measured:
        ratio = ours / row.theirs_gib
        shown = f"**{ratio:.2f}**" if ratio > 1 else f"{ratio:.2f}"
        lines.append(f"| {row.label} | {row.features} | {row.theirs_gib:.1f} | {ours:.1f} | {shown} |")
    return "\n".join(lines)
