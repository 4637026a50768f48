"""Expert parallel (parallelism.expert_parallel_degree) against one process, fp32 on gloo.

Every run sees the same 4 sequences per step (data-parallel degree D runs local_batch_size 4 / D)
from the same seed-initialised weights (debugmodel_moe: 8 experts top 2, one shared, 4 blocks of
which 3 MoE; seq 32, lr 2e-2 after 2 warm-up steps). EP ranks are data-parallel ranks: each routes
its own sequences and sends every token to the rank holding its expert, so the routing, the
token counts that move the expert bias, and the loss must be one process's; only the order of
sums differs (each expert's matmul sees the EP ranks' tokens together, and its gradient is summed
over them). Three launches: one process (layouts), 2 ranks (ckpt_jobs: EP 2 straight with a
checkpoint at step 3, its resume at EP 2, and at EP 1 = plain FSDP 2), 4 ranks (layouts:
dp_shard 4 with EP 2 = FSDP 2 over each expert shard, with a checkpoint at step 3 and its resume
at the same layout; EP 4; EP 2 over cp 2 x dp_shard 2; PP 2 x dp_shard 2 with EP 2, each stage's
experts split over its 2 data-parallel ranks; HSDP 2 x 2 with EP 2 inside each replica; EP 2 x
FSDP 2 under full activation checkpointing).

Measured on this 2-core CPU, torch 2.13: max relative loss difference to one process over 5 steps
<= 1.9e-7 on every EP layout (bound 1e-6; PP 2 x EP 2: 1.6e-7), grad norm <= 2.1e-7, step-1 full
gradients <= 2.7e-7 (PP 2 x EP 2: 2.2e-7; HSDP 2 x 2 x EP 2: 2.2e-7; EP 2 x FSDP 2 with full AC: 2.1e-7); moe_load_max / moe_load_min equal at every step; resume
at EP 2 and at EP 2 x FSDP 2 bitwise; the EP 2 checkpoint resumed at EP 1 (FSDP 2) <= 6.8e-8
(step 4 bitwise). ~65-130 s for the module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.support import NO_COMPILER, by_step, c_compiler, launch_worker

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

STEPS, RESUME_FROM = 5, 3
GLOBAL_BATCH = 4
BASE = ("--model.name", "moe", "--model.flavor", "debugmodel_moe", "--training.seq_len", "32",
        "--training.steps", str(STEPS), "--optimizer.lr", "2e-2", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--training.seed", "0", "--mixed_precision.enabled", "false")
# Reduction order only: measured <= 2.5e-7 (see the module docstring).
REL_TOL = 1e-6
SHARD, CP, EP, PP = ("--parallelism.data_parallel_shard_degree", "--parallelism.context_parallel_degree",
                     "--parallelism.expert_parallel_degree", "--parallelism.pipeline_parallel_degree")
REPLICATE, AC = "--parallelism.data_parallel_replicate_degree", "--activation_checkpoint.mode"
# name: (ranks, data-parallel degree, overrides)
LAYOUTS = {
    "ep2": (2, 2, (SHARD, "2", EP, "2")),
    "ep2_fsdp2": (4, 4, (SHARD, "4", EP, "2")),
    "ep4": (4, 4, (SHARD, "4", EP, "4")),
    "ep2_cp2": (4, 2, (SHARD, "2", CP, "2", EP, "2")),
    "pp2_ep2": (4, 2, (SHARD, "2", PP, "2", EP, "2")),
    # HSDP: experts split over EP inside each replica, their gradients all-reduced across replicas.
    "hsdp2_ep2": (4, 4, (REPLICATE, "2", SHARD, "2", EP, "2")),
    # Full AC: the recomputed forward re-routes and re-dispatches; tokens must still count once.
    "ep2_fsdp2_ac": (4, 4, (SHARD, "4", EP, "2", AC, "full")),
}
# Pipeline stages hold disjoint parameters: their step-1 gradients are those of ranks 0 and 2.
GRAD_RANKS = {"pp2_ep2": (0, 2)}
CKPT = ("--checkpoint.enable", "--checkpoint.interval", str(RESUME_FROM))
KEYS = ("loss", "grad_norm", "lr")
LOAD = ("moe_load_max", "moe_load_min")


def args(name: str, *extra: str) -> list[str]:
    _, dp, overrides = LAYOUTS[name] if name != "single" else (1, 1, ())
    return [*BASE, "--training.local_batch_size", str(GLOBAL_BATCH // dp), *overrides, *extra]


class Launches:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.outputs: dict[str, str] = {}

    def folder(self, key: str, name: str) -> Path:
        if key not in self.outputs:
            getattr(self, f"_launch_{key}")()
        out = self.root / key / name
        assert (out / "metrics.jsonl").is_file(), f"{name} did not finish:\n{self.outputs[key][-6000:]}"
        return out

    def _launch(self, key: str, worker: str, nproc: int, jobs: list[dict]) -> None:
        self.outputs[key] = f"the {key} launch did not finish"
        result = launch_worker(worker, self.root / key, jobs, nproc, timeout=480, check=False)
        self.outputs[key] = result.describe(6000)

    def _launch_nproc1(self) -> None:
        self._launch("nproc1", "layouts", 1, [{"name": "single", "args": args("single"), "grads": True}])

    def _launch_nproc2(self) -> None:
        out = self.root / "nproc2"
        step = f"checkpoint/step-{RESUME_FROM}"
        copy = lambda dst: [[str(out / "ep2" / step), str(out / dst / step)]]  # noqa: E731
        # The compiled run first, in a fresh process (nothing cached by an eager run before it).
        compiled = [{"args": args("ep2", "--compile.enable", "--job.dump_folder", str(out / "ep2_compiled"))}]
        self._launch("nproc2", "ckpt_jobs", 2, [
            *(compiled if c_compiler() else []),
            {"args": args("ep2", *CKPT, "--job.dump_folder", str(out / "ep2"))},
            {"args": args("ep2", *CKPT, "--job.dump_folder", str(out / "resume_ep2")), "copy": copy("resume_ep2")},
            # The same ranks and data-parallel degree (the loader's position carries over), no EP.
            {"args": args("ep2", *CKPT, EP, "1", "--job.dump_folder", str(out / "resume_ep1")),
             "copy": copy("resume_ep1")},
        ])

    def _launch_nproc4(self) -> None:
        # EP 2 x FSDP 2 also checkpoints at step 3; its resume reads that checkpoint folder in place
        # (the layouts worker has no copy step) and rewrites only its step-5 save.
        saved = self.root / "nproc4" / "ep2_fsdp2" / "checkpoint"
        jobs = [{"name": name, "args": args(name, *(CKPT if name == "ep2_fsdp2" else ())), "grads": True}
                for name, (n, _, _) in LAYOUTS.items() if n == 4]
        jobs.insert(1, {"name": "resume_ep2_fsdp2", "args": args("ep2_fsdp2", *CKPT, "--checkpoint.folder", str(saved),
                                                                 "--checkpoint.load_step", str(RESUME_FROM))})
        self._launch("nproc4", "layouts", 4, jobs)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("ep"))


def steps_of(launches: Launches, name: str) -> dict[int, dict]:
    key = "nproc1" if name == "single" else f"nproc{LAYOUTS[name][0]}"
    return by_step(launches.folder(key, name))


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_trains_one_process_curve(launches: Launches, name: str) -> None:
    single, got = steps_of(launches, "single"), steps_of(launches, name)
    assert sorted(got) == sorted(single) == list(range(1, STEPS + 1))
    worst = {k: max(rel(got[s][k], single[s][k]) for s in single) for k in ("loss", "grad_norm")}
    print(f"{name}: max relative difference to one process: {worst}")
    assert worst["loss"] <= REL_TOL and worst["grad_norm"] <= REL_TOL, worst
    # The same routing: every step's most and least loaded expert, summed over all ranks.
    for s in single:
        assert [got[s][k] for k in LOAD] == [single[s][k] for k in LOAD], (s, got[s], single[s])
    # Balancing really moved the bias, so the equality above covers the bias update too.
    assert len({single[s]["moe_load_max"] for s in single}) > 1


@pytest.mark.parametrize("name", [name for name, (n, _, _) in LAYOUTS.items() if n == 4])
def test_expert_gradients_are_the_mean_over_all_ranks(launches: Launches, name: str) -> None:
    """Step 1's full gradients (after clipping, whose factor agrees to 1e-7): each expert's is the
    sum over every EP rank's tokens, divided by the whole data-parallel size, not by efsdp's
    alone (EP 4 has efsdp 1, EP 2 efsdp 2). A factor of ep would leave the loss almost unchanged
    (AdamW normalises) but shows here."""
    want = torch.load(launches.folder("nproc1", "single") / "grads_rank0.pt", weights_only=True)
    got = {k: v for r in GRAD_RANKS.get(name, (0,))
           for k, v in torch.load(launches.folder("nproc4", name) / f"grads_rank{r}.pt", weights_only=True).items()}
    assert got.keys() == want.keys() and any("experts.w1" in k for k in got)
    worst = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    print(f"{name}: step-1 gradients, max relative difference {worst:.2e}")
    assert worst <= REL_TOL


@pytest.mark.parametrize("name", ["ep2", "ep2_fsdp2"])
def test_expert_parallel_resume_is_bitwise(launches: Launches, name: str) -> None:
    """Saved at step 3, resumed at the same layout: steps 4-5 are the straight run's, bit for bit
    (EP 2 on 2 ranks; EP 2 x FSDP 2 on 4, the experts FSDP-sharded over efsdp 2)."""
    straight = steps_of(launches, name)
    resumed = by_step(launches.folder(f"nproc{LAYOUTS[name][0]}", f"resume_{name}"))
    assert sorted(resumed) == list(range(RESUME_FROM + 1, STEPS + 1))
    for s in resumed:
        assert [resumed[s][k] for k in (*KEYS, *LOAD)] == [straight[s][k] for k in (*KEYS, *LOAD)], s


def test_expert_parallel_checkpoint_holds_whole_experts(launches: Launches) -> None:
    """EP shards are DTensors of the full [E, ...] weights: the checkpoint has no EP degree in it."""
    meta = FileSystemReader(str(launches.folder("nproc2", "ep2") / "checkpoint" / f"step-{RESUME_FROM}")).read_metadata()
    shapes = {k: list(v.size) for k, v in meta.state_dict_metadata.items()
              if k.endswith(("experts.w1", "experts.w2", "experts.w3")) and hasattr(v, "size")}
    assert shapes and all(shape == [8, 64, 64] for shape in shapes.values()), shapes


def test_expert_parallel_checkpoint_resumes_without_ep(launches: Launches) -> None:
    """Saved at EP 2, loaded at EP 1 on the same 2 ranks (FSDP 2): DCP reshards the experts and
    their AdamW moments; the continuation is the EP 2 run's up to the order of sums."""
    straight = steps_of(launches, "ep2")
    resumed = by_step(launches.folder("nproc2", "resume_ep1"))
    assert sorted(resumed) == list(range(RESUME_FROM + 1, STEPS + 1))
    for s in resumed:
        for k in ("loss", "grad_norm"):
            assert rel(resumed[s][k], straight[s][k]) <= REL_TOL, (s, k, resumed[s][k], straight[s][k])
        assert [resumed[s][k] for k in LOAD] == [straight[s][k] for k in LOAD], s
    print("resume at EP 1:", {s: rel(resumed[s]["loss"], straight[s]["loss"]) for s in resumed})


@pytest.mark.skipif(c_compiler() is None, reason=NO_COMPILER)
def test_expert_parallel_compiles(launches: Launches) -> None:
    """Per-block torch.compile on EP 2, fp32: MoE blocks compile with graph breaks (the all-to-all's
    split sizes and the expert loop read counts on the host; fp32 takes the loop because torch's
    meta kernel for _grouped_mm is bf16-only). Measured: eager's losses, grad norms and loads bit
    for bit; a fresh process failed before (the grouped_mm probe's thread under dynamo)."""
    eager, compiled = steps_of(launches, "ep2"), by_step(launches.folder("nproc2", "ep2_compiled"))
    assert sorted(compiled) == sorted(eager)
    for s in eager:
        assert rel(compiled[s]["loss"], eager[s]["loss"]) <= REL_TOL, (s, compiled[s], eager[s])
        assert [compiled[s][k] for k in LOAD] == [eager[s][k] for k in LOAD], s
