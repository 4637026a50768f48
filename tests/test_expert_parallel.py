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
FSDP 2 under full activation checkpointing; EP 2 x TP 2 over dp_shard 2, with a checkpoint at
step 3, its resume, and EP 2 x FSDP 2's checkpoint continued at EP 2 x TP 2).

Measured on this 2-core CPU, torch 2.13: max relative loss difference to one process over 5 steps
<= 1.9e-7 on every EP layout (bound 1e-6; PP 2 x EP 2: 1.6e-7), grad norm <= 2.1e-7, step-1 full
gradients <= 2.7e-7 (PP 2 x EP 2: 2.2e-7; HSDP 2 x 2 x EP 2: 2.2e-7; EP 2 x FSDP 2 with full AC:
2.1e-7); moe_load_max / moe_load_min equal at every step; resume at EP 2 and at EP 2 x FSDP 2
bitwise; the EP 2 checkpoint resumed at EP 1 (FSDP 2) <= 6.8e-8 (step 4 bitwise); EP 2 x TP 2
(sequence parallel, shared expert split by TP): loss 1.4e-7, grad norm 1.1e-7, step-1 gradients
2.8e-7, routers and experts bitwise equal on the TP ranks, resume bitwise, EP 2 x FSDP 2's
checkpoint continued at EP 2 x TP 2 within 6.8e-8 (its 3 jobs add ~25 s). ~90-150 s for the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.support.launch import by_step, launch_worker
from tests.support.tolerances import assert_step_sync_budget

pytestmark = pytest.mark.dist


STEPS, RESUME_FROM = 5, 3
GLOBAL_BATCH = 4
BASE = (
    "--model.name",
    "moe",
    "--model.flavor",
    "debugmodel_moe",
    "--training.seq_len",
    "32",
    "--training.steps",
    str(STEPS),
    "--optimizer.lr",
    "2e-2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--training.seed",
    "0",
    "--mixed_precision.enabled",
    "false",
)
# Reduction order only: measured <= 2.5e-7 (see the module docstring).
REL_TOL = 1e-6
SHARD, CP, EP, PP = (
    "--parallelism.data_parallel_shard_degree",
    "--parallelism.context_parallel_degree",
    "--parallelism.expert_parallel_degree",
    "--parallelism.pipeline_parallel_degree",
)
REPLICATE, AC = "--parallelism.data_parallel_replicate_degree", "--activation_checkpoint.mode"
TP = "--parallelism.tensor_parallel_degree"
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
    # EP x TP (ETP = 1, sequence parallel on): each TP rank routes the whole sequence and exchanges
    # it with the EP peer of its own tp coordinate; the shared expert is split by TP.
    "ep2_tp2": (4, 2, (SHARD, "2", TP, "2", EP, "2")),
}
# 4-rank layouts that checkpoint at step 3 and resume from it, at the same layout and (CROSS) at
# another: EP 2 x FSDP 2's checkpoint continued at EP 2 x TP 2 (data-parallel degree 4 -> 2), and
# EP 2 x TP 2's continued without TP at EP 2 x FSDP 2 (2 -> 4).
RESUMED = ("ep2_fsdp2", "ep2_tp2")
CROSS = {"ep2_fsdp2_at_ep2_tp2": ("ep2_fsdp2", "ep2_tp2"), "ep2_tp2_at_ep2_fsdp2": ("ep2_tp2", "ep2_fsdp2")}
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
        self._launch(
            "nproc1",
            "layouts",
            1,
            [
                {"name": "single", "args": args("single"), "grads": True},
                {"name": "masked_single", "args": args("single"), "grads": True, "mask_labels": True},
            ],
        )

    def _launch_nproc2(self) -> None:
        out = self.root / "nproc2"
        step = f"checkpoint/step-{RESUME_FROM}"
        copy = lambda dst: [[str(out / "ep2" / step), str(out / dst / step)]]  # noqa: E731
        self._launch(
            "nproc2",
            "ckpt_jobs",
            2,
            [
                {"args": args("ep2", *CKPT, "--job.dump_folder", str(out / "ep2"))},
                {"args": args("ep2", *CKPT, "--job.dump_folder", str(out / "resume_ep2")), "copy": copy("resume_ep2")},
                # The same ranks and data-parallel degree (the loader's position carries over), no EP.
                {
                    "args": args("ep2", *CKPT, EP, "1", "--job.dump_folder", str(out / "resume_ep1")),
                    "copy": copy("resume_ep1"),
                },
            ],
        )

    def _launch_nproc4(self) -> None:
        # RESUMED layouts also checkpoint at step 3; their resumes read that checkpoint folder in
        # place (the layouts worker has no copy step) and rewrite only its step-5 save.
        def resume(name: str, saved_by: str, layout: str) -> dict:
            saved = self.root / "nproc4" / saved_by / "checkpoint"
            return {
                "name": name,
                "args": args(
                    layout, *CKPT, "--checkpoint.folder", str(saved), "--checkpoint.load_step", str(RESUME_FROM)
                ),
            }

        jobs = []
        for name, (n, _, _) in LAYOUTS.items():
            if n == 4:
                jobs.append({"name": name, "args": args(name, *(CKPT if name in RESUMED else ())), "grads": True})
            if name in RESUMED:
                jobs.append(resume(f"resume_{name}", name, name))
        jobs += [resume(name, saved_by, layout) for name, (saved_by, layout) in CROSS.items()]
        # Labels partly -100 (tests/support/inputs.mask_labels): step 1 leaves two of the 4 ranks no valid label.
        jobs.append({"name": "masked_ep2_fsdp2", "args": args("ep2_fsdp2"), "grads": True, "mask_labels": True})
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
    got = {
        k: v
        for r in GRAD_RANKS.get(name, (0,))
        for k, v in torch.load(launches.folder("nproc4", name) / f"grads_rank{r}.pt", weights_only=True).items()
    }
    assert got.keys() == want.keys() and any("experts.w1" in k for k in got)
    worst = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    print(f"{name}: step-1 gradients, max relative difference {worst:.2e}")
    assert worst <= REL_TOL


def test_masked_labels_under_expert_parallel_match_one_process(launches: Launches) -> None:
    """Unequal counts of valid labels per rank (two ranks with none at step 1): the loss divided by
    the step's global count times the data-parallel size, which the experts' gradient divide factor
    undoes as FSDP's mean does for the dense parameters, gives one process's mean over valid labels."""
    folder = launches.folder("nproc4", "masked_ep2_fsdp2")
    errors = sorted(folder.glob("error_rank*.txt"))
    assert not errors, errors[0].read_text()[-2000:]
    single, got = by_step(launches.folder("nproc1", "masked_single")), by_step(folder)
    assert sorted(got) == sorted(single) == list(range(1, STEPS + 1))
    worst = {k: max(rel(got[s][k], single[s][k]) for s in single) for k in ("loss", "grad_norm")}
    want = torch.load(launches.folder("nproc1", "masked_single") / "grads_rank0.pt", weights_only=True)
    grads = torch.load(folder / "grads_rank0.pt", weights_only=True)
    worst["grads"] = max(float((grads[k] - want[k]).norm() / want[k].norm()) for k in want)
    print(f"masked labels, ep2_fsdp2: max relative difference to one process: {worst}")
    assert max(worst.values()) <= REL_TOL, worst


@pytest.mark.parametrize("name", ["ep2", *RESUMED])
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
    meta = FileSystemReader(
        str(launches.folder("nproc2", "ep2") / "checkpoint" / f"step-{RESUME_FROM}")
    ).read_metadata()
    shapes = {
        k: list(v.size)
        for k, v in meta.state_dict_metadata.items()
        if k.endswith(("experts.w1", "experts.w2", "experts.w3")) and hasattr(v, "size")
    }
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


def test_tensor_parallel_replicas_of_experts_stay_identical(launches: Launches) -> None:
    """EP 2 x TP 2: after 5 steps each router's and expert's shard is bit for bit the same on the
    two TP ranks of a data-parallel coordinate (both routed the same gathered sequence and
    exchanged the same tokens), so the replicas never drift apart."""
    folder = launches.folder("nproc4", "ep2_tp2")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(4)]
    for a, b in ((0, 1), (2, 3)):  # tp innermost: ranks 2d and 2d + 1 share dp_shard coordinate d
        assert [ranks[r]["coordinate"][-1] for r in (a, b)] == [0, 1]
        assert ranks[a]["tp_replicated_params"] == ranks[b]["tp_replicated_params"]
        assert ranks[a]["tp_replicated_params_digest"] == ranks[b]["tp_replicated_params_digest"]
    names = ranks[0]["tp_replicated_params"]
    assert sum(n.endswith("router.weight") for n in names) == 3 and sum("experts.w" in n for n in names) == 9, names
    # Different data-parallel coordinates hold different shards: the digest is not vacuous.
    assert ranks[0]["tp_replicated_params_digest"] != ranks[2]["tp_replicated_params_digest"]


@pytest.mark.parametrize("name", list(CROSS))
def test_expert_parallel_checkpoint_moves_across_tensor_parallel(launches: Launches, name: str) -> None:
    """EP 2 x FSDP 2's step-3 checkpoint (experts FSDP-sharded over efsdp 2, no TP) continued at
    EP 2 x TP 2 (experts whole per EP rank, replicated over tp; dense weights split by TP; 2
    data-parallel ranks instead of 4), and EP 2 x TP 2's continued at EP 2 x FSDP 2: the same
    steps 4-5 up to the order of sums, same loads."""
    saved_by, _ = CROSS[name]
    straight = steps_of(launches, saved_by)
    resumed = by_step(launches.folder("nproc4", name))
    assert sorted(resumed) == list(range(RESUME_FROM + 1, STEPS + 1))
    worst = max(rel(resumed[s][k], straight[s][k]) for s in resumed for k in ("loss", "grad_norm"))
    print(f"{name}: max relative difference to the straight run {worst:.2e}")
    assert worst <= REL_TOL
    for s in resumed:
        assert [resumed[s][k] for k in LOAD] == [straight[s][k] for k in LOAD], s


@pytest.mark.parametrize("name", [name for name, (n, _, _) in LAYOUTS.items() if n == 4])
def test_expert_parallel_reads_the_split_sizes_once_per_layer_forward(launches: Launches, name: str) -> None:
    """Step 2's host syncs on every rank: the finiteness read and one stacked .tolist() of the
    split sizes per EP layer and forward; nothing in backward, nothing in full AC's recompute
    (ep2_fsdp2_ac), per stage under PP (pp2_ep2: its layers x 2 microbatches)."""
    folder = launches.folder("nproc4", name)
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    assert len(ranks) == 4 and all(r["ep_layers"] for r in ranks), ranks
    assert_step_sync_budget(ranks, name)
