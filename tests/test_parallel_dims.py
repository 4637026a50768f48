"""Parallel degrees, layout validation and the named device mesh: fast, in one process.

Degree arithmetic and every config-time refusal run without a process group. The mesh tests use
torch's fake process group (one process pretending to be rank R of 8), so they check real
`init_device_mesh` layouts for 8-rank worlds in milliseconds; tests/test_parallelisms.py checks
the same on real 4-process runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchtitan_amp.config import ConfigError, ParallelismConfig, load_config
from torchtitan_amp.distributed.parallel_dims import MESH_DIMS, ParallelDims
from torchtitan_amp.distributed.pipeline import stage_boundaries, validate_pipeline
from torchtitan_amp.distributed.tensor_parallel import apply_async_tp
from torchtitan_amp.train.parallelize import validate_layout

DEBUG_HEADS = (16, 16)  # debugmodel: n_heads, n_kv_heads
DEBUG_LAYERS = 6


def dims_of(
    world: int, rep: int = 1, shard: int = -1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1
) -> ParallelDims:
    return ParallelDims.from_config(
        ParallelismConfig(
            data_parallel_replicate_degree=rep,
            data_parallel_shard_degree=shard,
            tensor_parallel_degree=tp,
            pipeline_parallel_degree=pp,
            context_parallel_degree=cp,
            expert_parallel_degree=ep,
        ),
        world,
    )


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------
# Degrees against the world size


@pytest.mark.parametrize(
    "world, degrees, product",
    [
        (4, dict(rep=2, shard=2, tp=2), "replicate x shard x tp x pp x cp = 2 x 2 x 2 x 1 x 1 = 8"),
        (8, dict(shard=2, tp=2), "replicate x shard x tp x pp x cp = 1 x 2 x 2 x 1 x 1 = 4"),
        (2, dict(rep=1, shard=1, pp=4), "replicate x shard x tp x pp x cp = 1 x 1 x 1 x 4 x 1 = 4"),
        (4, dict(shard=2, cp=4), "replicate x shard x tp x pp x cp = 1 x 2 x 1 x 1 x 4 = 8"),
    ],
)
def test_degrees_that_do_not_multiply_to_the_world_size(world, degrees, product) -> None:
    with pytest.raises(ConfigError) as e:
        dims_of(world, **degrees)
    assert one_line_error(e) == f"{product} differs from the world size {world}"


def test_fill_degree_that_cannot_divide_the_world_size() -> None:
    with pytest.raises(ConfigError) as e:
        dims_of(4, rep=1, tp=3)
    assert one_line_error(e) == "replicate x tp x pp x cp = 1 x 3 x 1 x 1 = 3 does not divide the world size 4"


@pytest.mark.parametrize(
    "world, degrees, shard",
    [
        (1, dict(), 1),
        (8, dict(), 8),
        (8, dict(tp=2), 4),
        (8, dict(rep=2, tp=2), 2),
        (8, dict(pp=2, tp=2), 2),
        (8, dict(pp=2, rep=2, tp=2), 1),
        (4, dict(tp=4), 1),
    ],
)
def test_shard_degree_minus_one_fills_the_remaining_ranks(world, degrees, shard) -> None:
    dims = dims_of(world, **degrees)
    assert dims.dp_shard == shard
    assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp == world == dims.world_size


@pytest.mark.parametrize(
    "rep, shard, tp, pp, expected",
    [
        # (fsdp, ddp, hsdp, tp, pp, dp degree)
        (1, 1, 1, 1, (False, False, False, False, False, 1)),
        (1, 2, 1, 1, (True, False, False, False, False, 2)),
        (2, 1, 1, 1, (False, True, False, False, False, 2)),
        (2, 2, 1, 1, (True, False, True, False, False, 4)),
        (1, 1, 2, 1, (False, False, False, True, False, 1)),
        (1, 1, 1, 2, (False, False, False, False, True, 1)),
        (1, 2, 2, 2, (True, False, False, True, True, 2)),
        (2, 1, 1, 2, (False, True, False, False, True, 2)),
    ],
)
def test_enabled_properties(rep, shard, tp, pp, expected) -> None:
    dims = dims_of(rep * shard * tp * pp, rep, shard, tp, pp)
    got = (dims.fsdp_enabled, dims.ddp_enabled, dims.hsdp_enabled, dims.tp_enabled, dims.pp_enabled, dims.dp_degree)
    assert got == expected
    assert dims.dp_enabled == (expected[-1] > 1)


def test_mesh_before_build_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = dims_of(1).mesh
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = dims_of(1).get_mesh("dp")


def test_unknown_mesh_name_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as e:
        dims_of(1).get_mesh("dp_shard")
    assert one_line_error(e) == (
        "unknown mesh 'dp_shard'; allowed meshes: dp, fsdp, loss, ep, expert, expert_fsdp "
        "(the root mesh's dims: ParallelDims.mesh[name])"
    )


@pytest.mark.parametrize(
    "flag, value",
    [("tensor_parallel_degree", "0"), ("data_parallel_shard_degree", "-2"), ("pipeline_parallel_degree", "0")],
)
def test_degree_values_are_checked_at_parse_time(flag, value) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([f"--parallelism.{flag}", value])
    assert f"parallelism.{flag}" in one_line_error(e)


# ---------------------------------------------------------------------------------------------
# Layouts refused at config time (before any process group), each naming what to do instead


def layout(
    world: int,
    *overrides: str,
    rep: int = 1,
    shard: int = -1,
    tp: int = 1,
    pp: int = 1,
    heads: tuple[int, int] = DEBUG_HEADS,
) -> None:
    config = load_config(list(overrides))
    validate_layout(dims_of(world, rep, shard, tp, pp), config, *heads, DEBUG_LAYERS, "cpu")


def test_ddp_with_tp_is_refused_naming_fsdp_or_hsdp() -> None:
    with pytest.raises(ConfigError) as e:
        layout(4, rep=2, shard=1, tp=2)
    message = one_line_error(e)
    assert "DDP cannot hold DTensor parameters" in message
    assert "data_parallel_shard_degree (FSDP x TP)" in message and "HSDP x TP" in message
    # The named alternatives are accepted.
    layout(4, shard=2, tp=2)
    layout(8, rep=2, shard=2, tp=2)


@pytest.mark.parametrize(
    "heads, tp, name", [((16, 16), 3, "n_heads = 16"), ((8, 2), 4, "n_kv_heads = 2"), ((6, 6), 4, "n_heads = 6")]
)
def test_tp_degree_must_divide_query_and_kv_heads(heads, tp, name) -> None:
    with pytest.raises(ConfigError) as e:
        layout(tp, "--training.seq_len", "48", tp=tp, heads=heads)
    assert one_line_error(e) == f"'parallelism.tensor_parallel_degree' = {tp} must divide the model's {name}"


def test_gqa_heads_divisible_by_tp_are_accepted() -> None:
    layout(4, "--training.seq_len", "64", tp=4, heads=(32, 8))


def test_seq_len_must_divide_by_tp_under_sequence_parallel() -> None:
    with pytest.raises(ConfigError) as e:
        layout(2, "--training.seq_len", "33", tp=2)
    message = one_line_error(e)
    assert "'training.seq_len' = 33 must be divisible by tensor_parallel_degree = 2" in message
    assert "enable_sequence_parallel = false" in message
    layout(2, "--training.seq_len", "33", "--parallelism.enable_sequence_parallel", "false", tp=2)


def test_local_batch_must_be_a_multiple_of_the_pipeline_microbatch() -> None:
    with pytest.raises(ConfigError) as e:
        layout(
            2,
            "--training.local_batch_size",
            "5",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            pp=2,
        )
    assert (
        "'training.local_batch_size' = 5 must be a multiple of "
        "'parallelism.pipeline_parallel_microbatch_size' = 2" in one_line_error(e)
    )


def test_interleaved_1f1b_needs_a_multiple_of_pp_microbatches() -> None:
    with pytest.raises(ConfigError) as e:
        layout(
            2, "--training.local_batch_size", "3", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", pp=2
        )
    assert (
        "Interleaved1F1B needs the number of microbatches (local_batch_size / microbatch_size = 3) "
        "to be a multiple of pipeline_parallel_degree = 2" in one_line_error(e)
    )
    layout(2, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", pp=2)


def test_1f1b_needs_at_least_pp_microbatches() -> None:
    with pytest.raises(ConfigError) as e:
        layout(4, "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_schedule", "1F1B", pp=4)
    assert "1F1B needs at least pipeline_parallel_degree = 4 microbatches" in one_line_error(e)
    layout(4, "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_schedule", "GPipe", pp=4)


def test_split_points_are_checked_before_any_process_group() -> None:
    # debugmodel has 6 layers; PP 2 x Interleaved = 4 stages need 3 split points.
    with pytest.raises(ConfigError) as e:
        layout(
            2,
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_split_points",
            "layers.3",
            pp=2,
        )
    assert "needs 3 increasing layer indices in 1..5" in one_line_error(e)
    layout(2, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_split_points", "layers.1", pp=2)


@pytest.mark.parametrize(
    "points",
    [
        ["layers.3", "layers.2"],
        ["layers.2", "layers.2"],
        ["layers.0", "layers.3"],
        ["layers.2", "layers.6"],
        ["layers.2"],
    ],
)
def test_bad_split_points(points) -> None:
    with pytest.raises(ConfigError) as e:
        stage_boundaries(6, 3, points)
    assert one_line_error(e) == (
        f"'parallelism.pipeline_parallel_split_points' needs 2 increasing layer indices in 1..5, got {points}"
    )


def test_split_points_must_name_layers() -> None:
    with pytest.raises(ConfigError) as e:
        stage_boundaries(6, 2, ["norm"])
    assert "must look like 'layers.N'" in one_line_error(e)


@pytest.mark.parametrize(
    "n_layers, stages, points, expected",
    [
        (6, 2, [], [0, 3]),
        (6, 4, [], [0, 2, 4, 5]),  # the remainder goes to early stages: the last one holds the head
        (5, 5, [], [0, 1, 2, 3, 4]),
        (6, 3, ["layers.1", "layers.5"], [0, 1, 5]),
    ],
)
def test_stage_boundaries(n_layers, stages, points, expected) -> None:
    assert stage_boundaries(n_layers, stages, points) == expected


def test_more_stages_than_layers() -> None:
    with pytest.raises(ConfigError) as e:
        stage_boundaries(6, 8, [])
    assert one_line_error(e) == "8 pipeline stages need at least as many layers; the model has 6"


def test_validate_pipeline_returns_boundaries_and_microbatches() -> None:
    p = ParallelismConfig(
        pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_microbatch_size=2
    )
    assert validate_pipeline(dims_of(2, pp=2), p, 6, 8) == ([0, 2, 4, 5], 4)


# ---------------------------------------------------------------------------------------------
# Async TP


@pytest.mark.parametrize(
    "overrides, world, tp, missing",
    [
        ((), 2, 2, ["a CUDA device (this run is on cpu)", "compile.enable = true"]),
        (("--compile.enable",), 2, 2, ["a CUDA device (this run is on cpu)"]),
        (("--compile.enable",), 1, 1, ["a CUDA device (this run is on cpu)", "tensor_parallel_degree > 1"]),
    ],
)
def test_async_tp_outside_cuda_compile_and_tp_is_refused(overrides, world, tp, missing) -> None:
    with pytest.raises(ConfigError) as e:
        layout(world, "--parallelism.enable_async_tensor_parallel", "--training.device", "cpu", *overrides, tp=tp)
    message = one_line_error(e)
    assert message.startswith("'parallelism.enable_async_tensor_parallel' needs " + ", ".join(missing) + " (")
    assert message.endswith("set it to false otherwise")


def test_async_tp_is_off_by_default() -> None:
    assert load_config([]).parallelism.enable_async_tensor_parallel is False


def test_apply_async_tp_turns_on_inductor_micro_pipelining() -> None:
    # inductor's own patch(), not monkeypatch: on torch 2.11 monkeypatch's undo leaves the config
    # without the key, and every later compile in the process fails ("... does not exist").
    import torch._inductor.config as inductor_config

    class Mesh:
        def get_group(self):
            raise AssertionError("torch 2.13 registers symmetric memory itself: no group lookup expected")

    with inductor_config.patch(_micro_pipeline_tp=False):
        apply_async_tp(Mesh())  # type: ignore[arg-type]
        assert inductor_config._micro_pipeline_tp is True


# ---------------------------------------------------------------------------------------------
# The named mesh, on torch's fake process group (rank RANK of an 8-rank world)

WORLD, RANK = 8, 5


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # An earlier test that leaked its process group is a bug to see, not a reason to skip the mesh
    # tests (test_precision.py checks the same: no test starts one in-process without ending it).
    assert not dist.is_initialized(), "a process group already exists in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim")
@pytest.mark.parametrize(
    "degrees",
    [
        dict(),
        dict(tp=2),
        dict(rep=2, tp=2),
        dict(pp=2, tp=2),
        dict(pp=2, rep=2, shard=1, tp=2),
        dict(rep=2, shard=4),
        dict(shard=2, cp=2, tp=2),
        dict(rep=2, shard=1, cp=2, tp=2),
        dict(pp=2, cp=4),
    ],
)
def test_mesh_names_shape_and_flattened_dp(fake_world, degrees) -> None:
    dims = dims_of(WORLD, **degrees)
    mesh = dims.build_mesh("cpu")
    assert mesh is dims.mesh
    assert mesh.mesh_dim_names == MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    assert tuple(mesh.shape) == shape
    # Row-major rank order: tp is innermost (TP peers are neighbouring ranks, on one node), then
    # cp, pp outermost.
    assert torch.equal(mesh.mesh, torch.arange(WORLD).reshape(shape))
    coord = list(mesh.get_coordinate())
    assert coord == [int(c) for c in torch.nonzero(mesh.mesh == RANK)[0]]
    for name, size in zip(MESH_DIMS, shape):
        assert mesh[name].size() == size
    pp_i, rep_i, shard_i, cp_i, tp_i = coord
    assert dims.cp_rank(RANK) == cp_i
    # The flattened dp view: every rank with this rank's pp, cp and tp coordinates, replicate-major.
    dp = dims.get_mesh("dp")
    assert dp.mesh_dim_names == ("dp",)
    assert mesh["dp"].mesh.tolist() == dp.mesh.tolist()  # what the trainer slices today
    assert dp.size() == dims.dp_degree
    assert dp.mesh.tolist() == mesh.mesh[pp_i, :, :, cp_i, tp_i].flatten().tolist()
    assert dp.get_local_rank() == rep_i * dims.dp_shard + shard_i == dims.dp_rank(RANK)
    # FSDP shards over dp_shard x cp (with dp_replicate in front under HSDP); the loss is averaged
    # over every data- and context-parallel rank.
    fsdp = dims.get_mesh("fsdp")
    shard_cp = mesh.mesh[pp_i, rep_i, :, :, tp_i].flatten().tolist()
    if dims.hsdp_enabled:
        assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert fsdp.mesh.tolist() == mesh.mesh[pp_i, :, :, :, tp_i].flatten(1).tolist()
    else:
        assert fsdp.mesh_dim_names == ("dp_shard_cp",) and fsdp.mesh.tolist() == shard_cp
    assert dims.get_mesh("loss").mesh.tolist() == mesh.mesh[pp_i, :, :, :, tp_i].flatten().tolist()


@pytest.mark.parametrize("argv, expected", [([], 25.0), (["--parallelism.ddp_bucket_cap_mb", "7.5"], 7.5)])
def test_ddp_gets_the_configured_bucket_size(monkeypatch, argv: list[str], expected: float) -> None:
    """parallelize_model hands parallelism.ddp_bucket_cap_mb to replicate (recorded, not run)."""
    from types import SimpleNamespace

    from torchtitan_amp.models import get_family
    from torchtitan_amp.precision import comm_hooks
    from torchtitan_amp.train import data_parallel, parallelize

    seen: dict = {}
    monkeypatch.setattr(data_parallel, "replicate", lambda model, **kw: seen.update(kw))
    monkeypatch.setattr(comm_hooks, "install_comm_hook", lambda model, state: None)
    mesh = SimpleNamespace(get_group=lambda: None, mesh_dim_names=("dp_replicate",))
    dims = SimpleNamespace(
        tp_enabled=False,
        cp_enabled=False,
        ep_enabled=False,
        fsdp_enabled=False,
        ddp_enabled=True,
        mesh={"dp_replicate": mesh},
    )
    # What the appliers read of a plan: no autocast (no fp32 islands), no compress hook.
    plan = SimpleNamespace(autocast_dtype=None, comm_hook="none", lora=None)
    parallelize.parallelize_model(torch.nn.Linear(2, 2), get_family("llama3"), dims, plan, load_config(argv))
    assert seen["bucket_cap_mb"] == expected and seen["device_mesh"] is mesh


# ---------------------------------------------------------------------------------------------
# Expert parallel: EP borrows the innermost ranks of dp_shard x cp


@pytest.mark.parametrize(
    "world, degrees, message",
    [
        (
            4,
            dict(shard=4, ep=3),
            "'parallelism.expert_parallel_degree' = 3 must divide data_parallel_shard_degree "
            "x context_parallel_degree = 4 x 1 = 4 (EP borrows its ranks from FSDP's)",
        ),
        (
            4,
            dict(rep=2, shard=2, ep=4),
            "'parallelism.expert_parallel_degree' = 4 must divide "
            "data_parallel_shard_degree x context_parallel_degree = 2 x 1 = 2 "
            "(EP borrows its ranks from FSDP's)",
        ),
        # Under TP too: EP takes no TP ranks (every TP rank holds the experts its EP rank holds).
        (
            4,
            dict(shard=2, tp=2, ep=4),
            "'parallelism.expert_parallel_degree' = 4 must divide "
            "data_parallel_shard_degree x context_parallel_degree = 2 x 1 = 2 "
            "(EP borrows its ranks from FSDP's)",
        ),
    ],
)
def test_ep_must_divide_shard_times_cp(world, degrees, message) -> None:
    with pytest.raises(ConfigError) as e:
        dims_of(world, **degrees)
    assert one_line_error(e) == message


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--parallelism.expert_parallel_degree", "2"],
            "'parallelism.expert_parallel_degree' = 2 needs a model with routed experts; "
            "model.name = 'llama3' has none: use 1",
        ),
        (
            [
                "--model.name",
                "moe",
                "--model.flavor",
                "debugmodel_moe",
                "--parallelism.expert_parallel_degree",
                "3",
                "--parallelism.data_parallel_shard_degree",
                "3",
            ],
            "'parallelism.expert_parallel_degree' = 3 must divide the model's n_routed_experts = 8",
        ),
    ],
)
def test_ep_layout_refusals(argv, message) -> None:
    config = load_config(["--training.seq_len", "32", *argv])
    dims = ParallelDims.from_config(config.parallelism, 3 if "3" in argv else 4)
    with pytest.raises(ConfigError) as e:
        validate_layout(dims, config, 2, 2, 4, "cpu")
    assert one_line_error(e) == message


def test_ep_composes_with_tp() -> None:
    """EP x TP (ETP = 1) passes the layout checks: it used to be refused in one line ("the experts
    have no tensor-parallel plan")."""
    config = load_config(
        [
            "--training.seq_len",
            "32",
            "--model.name",
            "moe",
            "--model.flavor",
            "debugmodel_moe",
            "--parallelism.expert_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ]
    )
    dims = ParallelDims.from_config(config.parallelism, 4)
    assert (dims.dp_shard, dims.tp, dims.ep) == (2, 2, 2)
    assert validate_layout(dims, config, 2, 2, 4, "cpu") == ([0], 1)


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim")
@pytest.mark.parametrize(
    "degrees",
    [
        dict(shard=8, ep=2),
        dict(shard=8, ep=8),
        dict(shard=4, cp=2, ep=4),
        dict(rep=2, shard=4, ep=2),
        dict(pp=2, shard=4, ep=2),
        dict(shard=4, tp=2, ep=2),
        dict(shard=2, cp=2, tp=2, ep=2),
    ],
)
def test_ep_meshes_split_the_fsdp_ranks(fake_world, degrees) -> None:
    """ep takes consecutive ranks of FSDP's dp_shard x cp, efsdp strides over the rest; the dense
    meshes are those without EP."""
    dims = dims_of(WORLD, **degrees)
    plain = {k: v for k, v in degrees.items() if k != "ep"}
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == MESH_DIMS
    fsdp = dims.get_mesh("fsdp").mesh.flatten().tolist()  # this rank's dp_replicate x dp_shard x cp ranks
    shard_cp = (
        fsdp[-dims.fsdp_shard :]
        if not dims.hsdp_enabled
        else [r for row in dims.get_mesh("fsdp").mesh.tolist() for r in row if RANK in row]
    )
    i = shard_cp.index(RANK)
    assert dims.get_mesh("ep").mesh_dim_names == ("ep",)
    assert dims.get_mesh("ep").mesh.tolist() == shard_cp[i - i % dims.ep : i - i % dims.ep + dims.ep]
    expert = dims.get_mesh("expert_fsdp")
    efsdp = shard_cp[i % dims.ep :: dims.ep]
    assert dims.efsdp == len(efsdp) == dims.fsdp_shard // dims.ep
    if dims.hsdp_enabled:
        assert expert.mesh_dim_names == ("dp_replicate", "efsdp")
        assert expert.mesh.shape == (dims.dp_replicate, dims.efsdp) and efsdp in expert.mesh.tolist()
    else:
        assert expert.mesh_dim_names == ("efsdp",) and expert.mesh.tolist() == efsdp
    # The experts' DTensor mesh: ep, then under TP the rank's tp row (ETP = 1: replicated over tp),
    # so an EP group is the ranks of one tp coordinate.
    ep_ranks = dims.get_mesh("ep").mesh.tolist()
    if dims.tp_enabled:
        assert dims.get_mesh("expert").mesh_dim_names == ("ep", "tp")
        assert dims.get_mesh("expert").mesh.tolist() == [
            [r - r % dims.tp + t for t in range(dims.tp)] for r in ep_ranks
        ]
        assert all(r % dims.tp == RANK % dims.tp for r in ep_ranks)
    else:
        assert dims.get_mesh("expert") is dims.get_mesh("ep")
    # The dense meshes do not change with EP.
    assert dims_of(WORLD, **plain).fsdp_shard == dims.fsdp_shard and dims.ep_enabled


@pytest.mark.parametrize("mesh", ["ep", "expert", "expert_fsdp"])
def test_ep_meshes_need_ep(mesh: str) -> None:
    with pytest.raises(RuntimeError, match="expert_parallel_degree > 1"):
        _ = dims_of(1).get_mesh(mesh)
