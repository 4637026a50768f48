"""The precision plan in-process: path choice per layout, the report, conflicts, the DDP compress
hook, FSDP policies and input casts, forward/backward contexts and the loss scaler.

No process group is started here: layouts are ParallelDims built directly, the comm hook runs on a
fake bucket and a fake all-reduce. The multi-process proofs are in test_precision_dist.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import train as train_script
from torchtitan_amp import precision as precision_mod
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models.llama3.model import RMSNorm, Transformer, build_model_args
from torchtitan_amp.precision import (
    CompressHookState,
    LossScaler,
    PrecisionError,
    PrecisionPlan,
    autocast,
    comm_hooks,
    compress_hook,
    fsdp,
    resolve_module_classes,
    scaler,
)
from torchtitan_amp.precision import report as precision_report

# (dp_replicate, dp_shard, tp, pp)
LAYOUTS = {
    "single": (1, 1, 1, 1),
    "ddp": (2, 1, 1, 1),
    "fsdp": (1, 2, 1, 1),
    "hsdp": (2, 2, 1, 1),
    "tp": (1, 1, 2, 1),
    "pp": (1, 1, 1, 2),
    "fsdp_tp": (1, 2, 2, 1),
}


def dims(layout: str) -> ParallelDims:
    r, s, t, p = LAYOUTS[layout]
    return ParallelDims(r, s, t, p, r * s * t * p)


def plan(layout: str = "single", *argv: str) -> PrecisionPlan:
    """The plan's rules, whatever this CPU does well: without a probe "auto" means on (the
    hardware answer has its own tests below)."""
    return PrecisionPlan.from_config(load_config(list(argv)), dims(layout), "cpu", probe=None)


def tiny_model(n_layers: int = 1) -> Transformer:
    args = build_model_args("debugmodel", vocab_size=258, max_seq_len=16)
    args.n_layers, args.dim, args.n_heads = n_layers, 32, 2
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def one_line_error(*argv: str, layout: str = "single") -> str:
    with pytest.raises(PrecisionError) as info:
        plan(layout, *argv)
    message = str(info.value)
    assert "\n" not in message and message
    return message


# ---------------------------------------------------------------------------------------------
# Which path a layout takes


@pytest.mark.parametrize(
    "layout,path",
    [
        ("single", "autocast"),
        ("ddp", "autocast"),
        ("tp", "autocast"),
        ("pp", "autocast"),
        ("fsdp", "fsdp"),
        ("hsdp", "fsdp"),
        ("fsdp_tp", "fsdp"),
    ],
)
def test_default_bf16_path_per_layout(layout: str, path: str) -> None:
    p = plan(layout)
    assert p.path == path
    assert p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32
    assert p.output_dtype == p.storage_dtype == torch.float32
    assert p.comm_hook == "none" and p.grad_scaler == "none"
    assert p.autocast_dtype == (torch.bfloat16 if path == "autocast" else None)
    assert p.safe_modules == (nn.Linear,)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disabled_is_full_fp32_on_every_layout(layout: str) -> None:
    p = plan(layout, "--mixed_precision.enabled", "false", "--mixed_precision.reduce_dtype", "bfloat16")
    assert p.path == "full" and p.autocast_dtype is None
    assert p.param_dtype == p.reduce_dtype == p.output_dtype == torch.float32
    assert p.comm_hook == "none" and p.grad_scaler == "none" and p.safe_modules == ()


@pytest.mark.parametrize("reduce,hook", [("float32", "none"), ("bfloat16", "bf16_compress")])
def test_ddp_comm_hook_follows_reduce_dtype(reduce: str, hook: str) -> None:
    assert plan("ddp", "--mixed_precision.reduce_dtype", reduce).comm_hook == hook
    # No hook without DDP: nothing is all-reduced by DDP there.
    for layout in ("single", "fsdp", "hsdp", "tp"):
        assert plan(layout, "--mixed_precision.reduce_dtype", reduce).comm_hook == "none"


def test_fp16_hook_and_scaler_per_layout() -> None:
    fp16 = ("--mixed_precision.param_dtype", "float16")
    assert plan("single", *fp16).grad_scaler == "GradScaler"
    ddp = plan("ddp", *fp16, "--mixed_precision.reduce_dtype", "float16")
    assert (ddp.comm_hook, ddp.grad_scaler) == ("fp16_compress", "GradScaler")
    for layout in ("fsdp", "hsdp", "fsdp_tp", "tp", "pp"):
        # Ranks holding different gradients must agree on inf/nan: ShardedGradScaler all-reduces it.
        assert plan(layout, *fp16).grad_scaler == "ShardedGradScaler", layout
    assert plan("single", *fp16).scaler_kwargs["init_scale"] == 65536.0


def test_fused_adamw_only_where_the_scaler_can_drive_it() -> None:
    """torch's fused AdamW cannot take ShardedGradScaler's shape-[1] inf flag (measured: fp16 on
    FSDP 2 with `fused` failed at step 1): `auto` falls back to foreach there, `fused` is refused."""
    fp16 = ("--mixed_precision.param_dtype", "float16")
    for layout in ("fsdp", "tp", "pp"):
        assert not plan(layout, *fp16).fused_optimizer_ok, layout
        message = one_line_error(*fp16, "--optimizer.implementation", "fused", layout=layout)
        assert "'optimizer.implementation' = 'fused'" in message and "'auto' or 'foreach'" in message
    assert plan("single", *fp16).fused_optimizer_ok and plan("ddp", *fp16).fused_optimizer_ok
    assert plan("fsdp").fused_optimizer_ok and plan("fsdp", "--optimizer.implementation", "fused").path == "fsdp"


def test_fp32_param_dtype_is_full_unless_something_is_low_precision() -> None:
    fp32 = ("--mixed_precision.param_dtype", "float32")
    assert plan("single", *fp32).path == "full"
    assert plan("ddp", *fp32).path == "full"
    # fp32 compute but bf16 gradients on the wire still needs the hook (autocast path, no autocast).
    ddp = plan("ddp", *fp32, "--mixed_precision.reduce_dtype", "bfloat16")
    assert (ddp.path, ddp.comm_hook, ddp.autocast_dtype) == ("autocast", "bf16_compress", None)
    assert plan("fsdp", *fp32).path == "fsdp"


def test_pure_bf16_training_dtype() -> None:
    p = plan("fsdp", "--training.dtype", "bfloat16", "--mixed_precision.enabled", "false")
    assert p.path == "full" and p.storage_dtype == p.param_dtype == p.reduce_dtype == torch.bfloat16
    # param_dtype equal to the storage dtype is not a conflict either.
    assert plan("single", "--training.dtype", "bfloat16").path == "full"


def test_torchtitan_aliases_feed_the_plan() -> None:
    p = plan("ddp", "--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "bfloat16")
    assert p.comm_hook == "bf16_compress"
    with pytest.raises(ConfigError):
        plan("ddp", "--training.mixed_precision_param", "float16", "--mixed_precision.param_dtype", "bfloat16")


def test_loss_scaling_settings_ignored_with_a_note_for_bf16() -> None:
    p = plan("single", "--mixed_precision.init_scale", "1024")
    assert p.grad_scaler == "none"
    assert any("only float16 needs a loss scale" in n for n in p.notes)


# ---------------------------------------------------------------------------------------------
# Conflicts: one-line errors at config time


def test_conflict_pure_bf16_with_other_param_dtype() -> None:
    msg = one_line_error("--training.dtype", "bfloat16", "--mixed_precision.param_dtype", "float16")
    assert "training.dtype" in msg and "param_dtype" in msg and "float16" in msg


@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp"])
def test_conflict_fp16_reduce_under_bf16_params(layout: str) -> None:
    msg = one_line_error("--mixed_precision.reduce_dtype", "float16", layout=layout)
    assert "reduce_dtype" in msg and "overflow" in msg


@pytest.mark.parametrize(
    "name",
    [
        "torch.nn.Linearr",  # typo
        "nosuchpackage.Module",  # unimportable module
        "Linear",  # not fully qualified
        "collections.OrderedDict",  # a class, but not an nn.Module
        "torch.nn.functional.linear",  # a function
    ],
)
def test_conflict_unknown_safe_module(name: str) -> None:
    msg = one_line_error("--mixed_precision.lower_precision_safe_modules", f"torch.nn.Linear,{name}")
    assert f"'{name}'" in msg and "lower_precision_safe_modules" in msg


def test_safe_modules_resolve_to_classes() -> None:
    assert resolve_module_classes(["torch.nn.Linear", "torchtitan_amp.models.llama3.model.RMSNorm"]) == (
        nn.Linear,
        RMSNorm,
    )


def test_conflict_device_without_mixed_precision() -> None:
    config = load_config([])
    with pytest.raises(PrecisionError, match="not available on device type 'meta'"):
        PrecisionPlan.from_config(config, dims("single"), "meta")
    # fp32 needs no support.
    off = load_config(["--mixed_precision.enabled", "false"])
    assert PrecisionPlan.from_config(off, dims("single"), "meta").path == "full"


def test_precision_error_is_a_config_error() -> None:
    assert issubclass(PrecisionError, ConfigError)


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.dtype", "bfloat16", "--mixed_precision.param_dtype", "float16"],
        ["--mixed_precision.reduce_dtype", "float16"],
        ["--mixed_precision.lower_precision_safe_modules", "torch.nn.Nope"],
    ],
)
def test_conflicts_exit_2_with_one_line_through_train_main(
    argv: list[str], capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        # A tiny run, so that a conflict that is no longer caught fails fast instead of training.
        code = train_script.main(
            [
                *argv,
                "--job.dump_folder",
                str(tmp_path),
                "--training.steps",
                "1",
                "--training.seq_len",
                "16",
                "--training.local_batch_size",
                "1",
            ]
        )
    finally:  # train.main configures logging for a real run; give pytest its handlers back
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err


# ---------------------------------------------------------------------------------------------
# Running the step inside a user's autocast


def test_check_no_user_autocast() -> None:
    p = plan("single")
    autocast.check_no_user_autocast(p)  # fine outside autocast
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(PrecisionError) as info:
            autocast.check_no_user_autocast(p)
    msg = str(info.value)
    assert "\n" not in msg and "torch.autocast('cpu')" in msg and "param_dtype = 'float16'" in msg
    # The plan's own forward context is not a user's autocast region to complain about when
    # entered by the trainer after the check; disabled autocast is no region at all.
    with torch.autocast("cpu", enabled=False):
        autocast.check_no_user_autocast(p)


def test_train_step_inside_user_autocast_is_refused(tmp_path: Path) -> None:
    from torchtitan_amp.train.trainer import Trainer

    trainer = Trainer(
        load_config(
            [
                "--model.flavor",
                "debugmodel",
                "--training.seq_len",
                "16",
                "--training.local_batch_size",
                "1",
                "--training.steps",
                "1",
                "--job.dump_folder",
                str(tmp_path),
            ]
        )
    )
    before = [p.detach().clone() for p in trainer.run.model.parameters()]
    batches = iter(trainer.run.dataloader)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(PrecisionError, match="param_dtype = 'bfloat16'"):
            trainer.train_step(batches)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.run.model.parameters()))
    assert trainer.run.lr_scheduler.last_epoch == 0
    trainer.train_step(batches)  # outside the region the same trainer trains
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.run.model.parameters()))


# ---------------------------------------------------------------------------------------------
# Report


def _groups(report: dict) -> dict[str, dict]:
    return {g["module_type"].rsplit(".", 1)[-1]: g for g in report["param_groups"]}


def test_report_fsdp(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = plan("fsdp", "--mixed_precision.reduce_dtype", "bfloat16")
    model = tiny_model()
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        report = precision_report.log_and_write_report(p, model, str(tmp_path), is_writer=True)
    assert json.loads((tmp_path / "precision_report.json").read_text()) == report
    assert {
        k: report[k]
        for k in ("path", "param_dtype", "reduce_dtype", "output_dtype", "comm_hook", "grad_scaler", "autocast_dtype")
    } == {
        "path": "fsdp",
        "param_dtype": "bfloat16",
        "reduce_dtype": "bfloat16",
        "output_dtype": "float32",
        "comm_hook": "none",
        "grad_scaler": "none",
        "autocast_dtype": None,
    }
    assert report["fp32_modules"] == ["torch.nn.modules.sparse.Embedding", "torchtitan_amp.models.llama3.model.RMSNorm"]
    groups = _groups(report)
    assert groups["Linear"] | {"num_params": 0} == {
        "module_type": "torch.nn.modules.linear.Linear",
        "num_params": 0,
        "storage_dtype": "float32",
        "compute_dtype": "bfloat16",
        "reduce_dtype": "bfloat16",
        "trained": True,
    }
    for name in ("Embedding", "RMSNorm"):
        assert (groups[name]["compute_dtype"], groups[name]["reduce_dtype"]) == ("float32", "float32")
    assert sum(g["num_params"] for g in groups.values()) == sum(q.numel() for q in model.parameters())
    assert report["fp32_islands"]
    # The start-up log shows the same as a short table.
    text = caplog.text
    assert "path=fsdp param=bf16 reduce=bf16" in text
    assert any("Linear" in r.message and "bf16" in r.message for r in caplog.records)


def test_report_autocast_reduce_follows_hook() -> None:
    model = tiny_model()
    single = precision_report.report(plan("single", "--mixed_precision.reduce_dtype", "bfloat16"), model)
    assert (
        _groups(single)["Linear"]["reduce_dtype"] == "float32"
    )  # nothing is reduced by DDP, so no low-precision reduce
    ddp = precision_report.report(plan("ddp", "--mixed_precision.reduce_dtype", "bfloat16"), model)
    assert ddp["comm_hook"] == "bf16_compress" and ddp["autocast_dtype"] == "bfloat16"
    assert _groups(ddp)["Linear"]["reduce_dtype"] == "bfloat16"
    assert _groups(ddp)["RMSNorm"]["reduce_dtype"] == "float32"


def test_report_honours_safe_module_list() -> None:
    report = precision_report.report(
        plan(
            "ddp",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
            "--mixed_precision.lower_precision_safe_modules",
            "torch.nn.Linear,torch.nn.Embedding",
        ),
        tiny_model(),
    )
    assert report["fp32_modules"] == ["torchtitan_amp.models.llama3.model.RMSNorm"]
    assert _groups(report)["Embedding"]["reduce_dtype"] == "bfloat16"


def test_report_disabled_says_fp32_everywhere() -> None:
    report = precision_report.report(plan("fsdp", "--mixed_precision.enabled", "false"), tiny_model())
    assert report["path"] == "full" and report["autocast_dtype"] is None
    assert report["param_dtype"] == report["reduce_dtype"] == report["output_dtype"] == "float32"
    assert all(
        g[k] == "float32" for g in report["param_groups"] for k in ("storage_dtype", "compute_dtype", "reduce_dtype")
    )
    assert any("enabled = false" in n for n in report["notes"])


def test_report_fp16_names_the_scaler() -> None:
    assert (
        precision_report.report(plan("fsdp", "--mixed_precision.param_dtype", "float16"), tiny_model())["grad_scaler"]
        == "ShardedGradScaler"
    )


# ---------------------------------------------------------------------------------------------
# FSDP policies and the block input cast


def test_fsdp_policies() -> None:
    p = plan("fsdp")
    low = fsdp.fsdp_policy(p, low_precision=True, cast_forward_inputs=False)
    assert (low.param_dtype, low.reduce_dtype, low.cast_forward_inputs) == (torch.bfloat16, torch.float32, False)
    fp32 = fsdp.fsdp_policy(p, low_precision=False)
    assert (fp32.param_dtype, fp32.reduce_dtype) == (torch.float32, torch.float32)
    root = fsdp.fsdp_policy(p, low_precision=True, output_dtype=torch.float32)
    assert root.output_dtype == torch.float32
    off = fsdp.fsdp_policy(plan("fsdp", "--mixed_precision.enabled", "false"), low_precision=True)
    assert off.param_dtype is None and off.reduce_dtype is None


class _Recorder(nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.seen = (x.dtype, cos.dtype, sin.dtype)
        return x


def test_cast_block_inputs_casts_hidden_state_only() -> None:
    block = _Recorder()
    fsdp.cast_block_inputs(plan("fsdp"), block)
    x, cos, sin = torch.randn(2, 4), torch.randn(4, 2), torch.randn(4, 2)
    assert block(x, cos, sin).dtype == torch.bfloat16
    assert block.seen == (torch.bfloat16, torch.float32, torch.float32)
    for other in ("single", "ddp"):  # autocast path: nothing to cast
        block = _Recorder()
        fsdp.cast_block_inputs(plan(other), block)
        block(x, cos, sin)
        assert block.seen == (torch.float32,) * 3


# ---------------------------------------------------------------------------------------------
# Forward / backward contexts, output cast, fp32 islands on the autocast path


def test_forward_context_autocasts_and_backward_context_does_not() -> None:
    p = plan("single")
    with autocast.forward_context(p):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        with autocast.backward_context(p):
            assert not torch.is_autocast_enabled("cpu")
    for layout, argv in (("fsdp", ()), ("single", ("--mixed_precision.enabled", "false"))):
        with autocast.forward_context(plan(layout, *argv)):
            assert not torch.is_autocast_enabled("cpu")


def test_cast_output() -> None:
    logits = torch.randn(2, 3, dtype=torch.bfloat16)
    assert autocast.cast_output(plan("single"), logits).dtype == torch.float32
    bf16_output = plan("single", "--mixed_precision.output_dtype", "bfloat16")
    assert autocast.cast_output(bf16_output, logits).dtype == torch.bfloat16
    assert autocast.cast_output(plan("fsdp"), logits).dtype == torch.bfloat16  # FSDP's root policy owns it
    tokens = torch.ones(2, dtype=torch.long)
    assert autocast.cast_output(plan("single"), tokens).dtype == torch.long


def test_autocast_path_runs_unsafe_modules_in_fp32() -> None:
    """With Linear left off the safe list, autocast must not run it in bf16."""
    p = plan("single", "--mixed_precision.lower_precision_safe_modules", "torch.nn.Embedding")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    autocast.apply_fp32_islands(p, model)
    with autocast.forward_context(p):
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32
    safe = plan("single")
    model = nn.Sequential(nn.Linear(4, 4))
    autocast.apply_fp32_islands(safe, model)
    with autocast.forward_context(safe):
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16


def test_rmsnorm_upcasts_itself() -> None:
    """Under FSDP the norm sees the bf16 residual stream: its own upcast makes it fp32 compute."""
    norm = RMSNorm(64)
    x = torch.randn(4, 64) * 3
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    exact = norm(x.bfloat16().float())
    assert torch.equal(out, exact.bfloat16())  # fp32 compute, one rounding at the end


# ---------------------------------------------------------------------------------------------
# DDP compress hook (fake bucket, fake 2-rank all-reduce)


class FakeBucket:
    def __init__(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        self._buffer = torch.cat([g.flatten() for g in grads])
        self._params = params
        offsets = torch.tensor([0] + [g.numel() for g in grads]).cumsum(0).tolist()
        self._grads = [self._buffer[a:b].view_as(g) for a, b, g in zip(offsets, offsets[1:], grads)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads


@pytest.fixture
def two_identical_ranks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """dist as seen by the hook: world size 2, all-reduce = sum of two identical ranks."""
    calls: list[tuple[torch.dtype, int]] = []

    class Work:
        def __init__(self, t: torch.Tensor) -> None:
            self.fut = torch.futures.Future()
            self.fut.set_result([t])

        def get_future(self) -> torch.futures.Future:
            return self.fut

    def all_reduce(t: torch.Tensor, group=None, async_op=False):  # type: ignore[no-untyped-def]
        calls.append((t.dtype, t.numel()))
        t.add_(t)
        return Work(t)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compress_hook_casts_safe_params_only(two_identical_ranks, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (3, 4), (5,)]  # safe, unsafe, safe, unsafe: interleaved ranges
    params = [nn.Parameter(torch.empty(s)) for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    safe = {id(params[0]), id(params[2])}
    state = CompressHookState(None, dtype, frozenset(safe))
    bucket = FakeBucket(params, grads)
    result = compress_hook(state, bucket).wait()
    assert result is bucket.buffer() and result.dtype == torch.float32
    n_safe, n_unsafe = 8 * 4 + 3 * 4, 4 + 5
    size = torch.finfo(dtype).bits // 8
    assert dict(state.bytes_sent) == {precision_mod.dtype_name(dtype): size * n_safe, "float32": 4 * n_unsafe}
    assert sorted(two_identical_ranks, key=str) == sorted([(dtype, n_safe), (torch.float32, n_unsafe)], key=str)
    for p, g, out in zip(params, grads, bucket.gradients()):
        if id(p) in safe:
            # mean of two identical ranks, computed in the wire dtype and handed back as fp32
            assert torch.equal(out, g.to(dtype).float())
            assert not torch.equal(out, g)
        else:
            assert torch.equal(out, g)


class _QueuedFuture(torch.futures.Future):
    """An nccl work's future as the host sees it: complete once the all-reduce is queued, its
    tensor holding the result only after wait() (which, on CUDA, makes the stream wait on nccl's)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._tensor, self._written = tensor, False
        self.set_result([tensor])

    def _write(self) -> None:
        if not self._written:
            self._tensor.add_(self._tensor)  # the sum of two identical ranks lands now
            self._written = True

    def wait(self):  # type: ignore[no-untyped-def]
        self._write()
        return super().wait()

    def value(self):  # type: ignore[no-untyped-def]
        self._write()
        return super().value()


def test_compress_hook_waits_for_every_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails with `collect_all(futures).then(...)`: that future completes when the collectives are
    queued and decompress would copy back each rank's own gradient / world size, not the mean."""

    class Work:
        def __init__(self, t: torch.Tensor) -> None:
            self.fut = _QueuedFuture(t)

        def get_future(self) -> torch.futures.Future:
            return self.fut

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: Work(t))
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (3, 4)]  # both a low-precision and an fp32 collective per bucket
    params = [nn.Parameter(torch.empty(s)) for s in shapes]
    grads = [torch.randn(s) * 1e-2 for s in shapes]
    state = CompressHookState(None, torch.bfloat16, frozenset({id(params[0]), id(params[2])}))
    bucket = FakeBucket(params, grads)
    result = compress_hook(state, bucket).wait()
    assert result is bucket.buffer()
    for i, (g, out) in enumerate(zip(grads, bucket.gradients())):
        expected = g.to(torch.bfloat16).float() if i != 1 else g
        assert torch.equal(out, expected), f"gradient {i} is not the mean of the ranks"


def test_compress_hook_state_lists_safe_params() -> None:
    model = tiny_model()
    p = plan("ddp", "--mixed_precision.reduce_dtype", "bfloat16")
    state = comm_hooks.comm_hook_state(p, model, None)
    linear = {id(q) for m in model.modules() if isinstance(m, nn.Linear) for q in m.parameters()}
    assert state is not None and state.low_precision_params == linear and state.dtype == torch.bfloat16
    assert comm_hooks.comm_hook_state(plan("ddp"), model, None) is None


def test_compress_hook_is_not_torch_bf16_hook_by_name() -> None:
    """torch refuses hooks *named* bf16_compress_hook / fp16_compress_hook on non-NCCL backends."""
    assert compress_hook.__name__ not in ("bf16_compress_hook", "fp16_compress_hook")


# ---------------------------------------------------------------------------------------------
# LossScaler


def _param_with_grad(value: float) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), value)
    return p, torch.optim.SGD([p], lr=0.1)


def test_loss_scaler_disabled_is_a_no_op() -> None:
    scaler = LossScaler(None)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and not scaler.enabled
    p, opt = _param_with_grad(1.0)
    scaler.unscale_(opt)
    assert scaler.step(opt) and torch.allclose(p.detach(), torch.full((3,), 0.9))
    assert scaler.state_dict() == {"scaler": {}, "skipped_steps": 0}


def test_loss_scaler_skips_backs_off_grows_and_round_trips() -> None:
    scaler = LossScaler(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    assert scaler.scale(torch.tensor(1.0)).item() == 2.0**10
    # An inf gradient: skipped, counted, scale backs off, the parameter is untouched.
    p, opt = _param_with_grad(float("inf"))
    scaler.unscale_(opt)
    assert not scaler.step(opt)
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**9
    assert torch.equal(p.detach(), torch.ones(3))
    # Finite (scaled) gradients: unscaled once, stepped; after growth_interval clean steps the
    # scale grows, and a growing step still counts as a real step.
    for _ in range(2):
        p.grad = torch.full((3,), 2.0**9)
        scaler.unscale_(opt)
        assert torch.equal(p.grad, torch.ones(3))  # the true gradient, as clipping must see it
        assert scaler.step(opt)
    assert scaler.get_scale() == 2.0**10 and scaler.skipped_steps == 1
    assert torch.allclose(p.detach(), torch.full((3,), 0.8))
    # state_dict round trip
    fresh = LossScaler(torch.amp.GradScaler("cpu"))
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.get_scale() == 2.0**10 and fresh.skipped_steps == 1


def test_loss_scaler_unscale_twice_in_one_step_raises() -> None:
    scaler = LossScaler(torch.amp.GradScaler("cpu", init_scale=4.0))
    scaler.scale(torch.tensor(1.0))
    _, opt = _param_with_grad(4.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)


def test_build_scaler_matches_plan() -> None:
    assert not scaler.build_scaler(plan("single")).enabled
    s = scaler.build_scaler(
        plan("single", "--mixed_precision.param_dtype", "float16", "--mixed_precision.init_scale", "256")
    )
    assert type(s.scaler) is torch.amp.GradScaler and s.get_scale() == 256.0
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(
        scaler.build_scaler(plan("fsdp", "--mixed_precision.param_dtype", "float16")).scaler, ShardedGradScaler
    )


def test_no_process_group_was_started() -> None:
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "setting",
    [
        ["--mixed_precision.reduce_dtype", "float32"],
        ["--mixed_precision.lower_precision_safe_modules", "torch.nn.Linear"],
    ],
)
def test_pure_bf16_refuses_settings_it_would_ignore(setting: list[str]) -> None:
    """Pure bf16 has no fp32 master copy: an explicit fp32 reduce or safe-module list would be
    silently ignored, so it is an error naming the field."""
    msg = one_line_error("--training.dtype", "bfloat16", *setting)
    assert f"'{setting[0][2:]}' has no effect with 'training.dtype' = 'bfloat16'" in msg
    # mixed_precision.enabled = false switches the whole section off, these settings included.
    assert plan("ddp", "--training.dtype", "bfloat16", "--mixed_precision.enabled", "false", *setting).path == "full"
    # The same dtype as the storage is what happens anyway: accepted.
    assert (
        plan(
            "ddp",
            "--training.dtype",
            "bfloat16",
            "--mixed_precision.enabled",
            "false",
            "--mixed_precision.reduce_dtype",
            "bfloat16",
        ).reduce_dtype
        == torch.bfloat16
    )


def test_the_precision_package_keeps_no_seam_for_tests() -> None:
    """The compress hook's tests patch torch.distributed itself: the package re-exports no module
    for tests to patch."""
    assert not hasattr(precision_mod, "dist")
