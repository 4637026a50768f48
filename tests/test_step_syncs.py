"""Host syncs per step: the stop flag is agreed every step on a gloo
group with a CPU tensor, so the poll never syncs the GPU; input batches go to CUDA from pinned
memory without blocking; the pinned-memory checkpoint stager is made once per run, refills its
host buffers at every save, copies after the step's kernels (a stream-order fake) and is closed. In
process, one rank, CPU."""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver as _sds

from tests.support.launch import read_metrics
from torchtitan_amp.checkpoint import preemption, saving, staging
from torchtitan_amp.checkpoint.format import scan_folder
from torchtitan_amp.config import load_config
from torchtitan_amp.data import build_dataloader
from torchtitan_amp.data.loader import to_device
from torchtitan_amp.data.tokenizer import ByteTokenizer
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.models.attention import host_copy
from torchtitan_amp.train import trainer as trainer_mod
from torchtitan_amp.train.trainer import Trainer

TINY = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--mixed_precision.enabled",
    "false",
]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU's matmul benchmark is not what these tests are about."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _trainer(tmp_path: Path, *extra: str) -> Trainer:
    return Trainer(load_config(["--job.dump_folder", str(tmp_path), *TINY, *extra]))


def _record_polls(monkeypatch: pytest.MonkeyPatch, trainer: Trainer) -> list[int]:
    """The steps at which the trainer asked the checkpointer whether to stop."""
    polled: list[int] = []
    real = trainer.run.checkpointer.should_stop

    def should_stop() -> bool:
        polled.append(trainer.step)
        return real()

    monkeypatch.setattr(trainer.run.checkpointer, "should_stop", should_stop)
    return polled


# ---------------------------------------------------------------------------------------------
# The stop poll: every step, on gloo, with a CPU tensor


class _Group:
    """Stands for a process group."""


def _fake_world(monkeypatch: pytest.MonkeyPatch, backend: str) -> list[dict[str, Any]]:
    """A 2-rank process group of `backend` as far as control_group can tell; the new_group calls."""
    made: list[dict[str, Any]] = []

    def new_group(**kwargs: Any) -> _Group:
        made.append(kwargs)
        return _Group()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "new_group", new_group)
    return made


def test_control_group_is_a_new_gloo_group_on_nccl_and_the_default_group_on_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _fake_world(monkeypatch, "nccl")
    group = process_groups.control_group(60.0)
    # The poll must not run on nccl's default group (a device sync per step): a gloo group of its own.
    assert isinstance(group, _Group)
    assert made == [{"backend": "gloo", "timeout": timedelta(seconds=60)}]
    made = _fake_world(monkeypatch, "gloo")
    assert process_groups.control_group(60.0) is None and made == []  # the default group is gloo already
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert process_groups.control_group(60.0) is None  # one rank: nothing to agree with
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert process_groups.control_group(60.0) is None


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_should_stop_all_reduces_a_cpu_tensor_on_the_control_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    made_with: list[float] = []
    real_control_group = process_groups.control_group

    def control_group(timeout_s: float) -> Any:
        made_with.append(timeout_s)
        with monkeypatch.context() as m:
            _fake_world(m, backend)
            return real_control_group(timeout_s)

    monkeypatch.setattr(process_groups, "control_group", control_group)
    # Checkpointing off: the poll runs anyway, so the group is made before the manager returns.
    trainer = _trainer(tmp_path, "--training.steps", "1", "--comm.timeout_seconds", "45")
    checkpointer = trainer.run.checkpointer
    assert made_with == [45.0]
    group = checkpointer._control_pg
    if backend == "nccl":
        assert isinstance(group, _Group) and group is not checkpointer.saver.async_group
    else:
        assert group is None
    # Two ranks on a GPU ("meta" stands for it: a tensor on the model's device would show here).
    checkpointer.ranks = dataclasses.replace(checkpointer.ranks, world_size=2)
    checkpointer.state.device = torch.device("meta")
    calls: list[tuple[torch.device, Any]] = []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        calls.append((t.device, group))
        t[0] = int(preemption.signal.SIGUSR1)  # a signal on the other rank

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(preemption, "_stop_signal", None)
    assert checkpointer.should_stop() is True
    assert calls == [(torch.device("cpu"), group)]


def test_trainer_polls_the_stop_flag_every_step_and_copies_batches_through_to_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(tmp_path, "--training.steps", "7", "--metrics.log_freq", "5")
    polled = _record_polls(monkeypatch, trainer)
    copies: list[tuple[torch.device, torch.device]] = []

    def recording_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append((t.device, device))
        return to_device(t, device)

    monkeypatch.setattr(trainer_mod, "to_device", recording_to_device)
    trainer.train()
    assert polled == list(range(1, 8))
    assert trainer.run.dataloader.pin_memory is False  # a CPU run: nothing to pin for
    assert copies == [(torch.device("cpu"), trainer.run.device)] * (2 * 7 * trainer.run.accum)  # inputs, labels


def test_a_stop_signal_during_a_step_saves_and_exits_after_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(
        tmp_path,
        "--training.steps",
        "12",
        "--metrics.log_freq",
        "5",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",
    )
    polled = _record_polls(monkeypatch, trainer)
    monkeypatch.setattr(preemption, "_stop_signal", None)
    step_fn = trainer.train_step

    def signalled_at_step_2(batches):  # type: ignore[no-untyped-def]
        if trainer.step == 2:
            monkeypatch.setattr(preemption, "_stop_signal", "SIGUSR1")
        return step_fn(batches)

    monkeypatch.setattr(trainer, "train_step", signalled_at_step_2)
    trainer.train()
    assert polled == [1, 2] and trainer.step == 2
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # step 2 is no log step
    complete = scan_folder(tmp_path / "checkpoint")[0]
    assert {s: info.kind for s, info in complete.items()} == {2: "full"}


# ---------------------------------------------------------------------------------------------
# Host -> device copies


class _OnDevice(str):
    """Stands for the device copy (a str subclass takes attributes, as a tensor does)."""

    device = torch.device("cuda", 0)


class _FakeBatch:
    """Stands for a host tensor: records what to_device does with it."""

    device = torch.device("cpu")

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.calls: list[tuple[Any, ...]] = []

    def is_pinned(self) -> bool:
        return self.pinned

    def pin_memory(self) -> _FakeBatch:
        self.calls.append(("pin_memory",))
        return self

    def to(self, device: torch.device, **kwargs: Any) -> str:
        self.calls.append(("to", device, kwargs))
        return _OnDevice("on device")


def test_to_device_copies_from_pinned_memory_without_blocking_on_cuda_only() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    pageable = _FakeBatch(pinned=False)
    copy = to_device(pageable, cuda)  # type: ignore[arg-type]
    assert copy == "on device"
    assert pageable.calls == [("pin_memory",), ("to", cuda, {"non_blocking": True})]
    assert host_copy(copy) is pageable  # kept with the copy: document ids are read on the host
    pinned = _FakeBatch(pinned=True)  # the loader pinned it already: no second copy
    to_device(pinned, cuda)  # type: ignore[arg-type]
    assert pinned.calls == [("to", cuda, {"non_blocking": True})]
    host = _FakeBatch(pinned=False)  # elsewhere a plain copy: nothing to pin, nothing to overlap
    to_device(host, cpu)  # type: ignore[arg-type]
    assert host.calls == [("to", cpu, {})]
    t = torch.arange(4)
    assert torch.equal(to_device(t, cpu), t)


def test_build_dataloader_pins_only_when_asked() -> None:
    # The trainer asks on CUDA only (pinning needs an accelerator); the loader pins in next().
    for pin in (False, True):
        loader = build_dataloader("pydoc", ByteTokenizer(), 32, 2, 0, 1, 0, pin_memory=pin)
        assert loader.pin_memory is pin


# ---------------------------------------------------------------------------------------------
# async_with_pinned_mem: one stager per run, after the step's kernels


class _CountingStager(staging.PinnedStager):
    """The run's stager minus what needs CUDA (pinning)."""

    made = 0
    closed = 0

    def __init__(self) -> None:
        type(self).made += 1
        super().__init__(pin_memory=False)
        real = self.copier.stage

        def copy(sd: Any, non_blocking: bool = False) -> Any:
            _log.append(f"copy on {_FakeStream.current}")
            time.sleep(0.05)  # a save that did not wait for its copies would return first
            return real(sd, non_blocking=non_blocking)

        self.copier.stage = copy

    def close(self) -> None:
        type(self).closed += 1
        super().close()


_log: list[str] = []


class _FakeStream:
    """A stream that logs what waits for what: the order a GPU would run them in."""

    current = "compute"  # the stream copies are queued on

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: _FakeStream) -> None:
        _log.append(f"{self.name} waits for {other.name}")

    def synchronize(self) -> None:
        _log.append(f"{self.name} synchronized")

    def __enter__(self) -> None:
        type(self).current = self.name

    def __exit__(self, *exc: object) -> None:
        type(self).current = "compute"


def _storages(obj: Any) -> list[torch.UntypedStorage]:
    if isinstance(obj, torch.Tensor):
        return [obj.untyped_storage()] if obj.numel() > 1 else []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [s for v in items for s in _storages(v)]


def test_pinned_stager_waits_for_the_step_reuses_its_buffers_and_a_finished_save_commits_at_the_next_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One stager per run, closed at the end; every save refills the first save's host buffers
    (torch 2.11's DefaultStager drops them after each save: there 171 of this run's 171 storages
    are new at the second save). On a stream-order fake: the staging stream waits for the compute stream (the
    optimizer step queued there) before the copies, which run on the staging stream; it is
    synchronized before the save returns, so the next optimizer step comes after."""
    # The mode is refused on CPU at config time: configure "async", switch after the checks.
    trainer = _trainer(
        tmp_path,
        "--training.steps",
        "5",
        "--metrics.log_freq",
        "100",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async",
    )
    trainer.config.checkpoint.async_mode = "async_with_pinned_mem"
    monkeypatch.setattr(saving, "PinnedStager", _CountingStager)
    monkeypatch.setattr(_CountingStager, "made", 0)
    monkeypatch.setattr(_CountingStager, "closed", 0)
    monkeypatch.setattr(staging, "compute_stream", lambda: _FakeStream("compute"))
    monkeypatch.setattr(staging, "staging_stream", lambda: _FakeStream("staging"))
    _log.clear()
    logged = trainer.run.optimizer.register_step_post_hook(lambda *_: _log.append("optimizer step"))
    staged, buffers = [], []  # what each save's upload writes (kept alive: no address is reused)
    execute_save = _sds._ThreadBasedAsyncCheckpointExecutor.execute_save

    def keep(done: Any) -> None:
        staged.append(done.result())
        buffers.append(sorted(s.data_ptr() for s in _storages(staged[-1])))

    def upload(self, sd, *args, **kwargs):  # type: ignore[no-untyped-def]
        sd.add_done_callback(keep)  # the staging future: waiting here would hide a save that did not
        return execute_save(self, sd, *args, **kwargs)

    monkeypatch.setattr(_sds._ThreadBasedAsyncCheckpointExecutor, "execute_save", upload)
    saver = trainer.run.checkpointer.saver
    async_save = saver._async_save
    monkeypatch.setattr(saver, "_async_save", lambda *a: (async_save(*a), _log.append("save returned"))[0])
    # Step 3 waits for step 2's upload: its own poll (every step) commits the save.
    seen: dict[str, Any] = {}
    step_fn, stop_fn = trainer.train_step, trainer.run.checkpointer.should_stop

    def step(batches):  # type: ignore[no-untyped-def]
        out = step_fn(batches)
        if trainer.step == 3:
            trainer.run.checkpointer.saver.pending.future.result()
        return out

    def should_stop() -> bool:
        stop = stop_fn()
        if trainer.step == 3:
            seen["pending"] = trainer.run.checkpointer.saver.pending
            seen["complete"] = sorted(scan_folder(tmp_path / "checkpoint")[0])
        return stop

    monkeypatch.setattr(trainer, "train_step", step)
    monkeypatch.setattr(trainer.run.checkpointer, "should_stop", should_stop)
    trainer.train()
    logged.remove()
    assert seen == {"pending": None, "complete": [2]}
    complete = scan_folder(tmp_path / "checkpoint")[0]
    assert {s: info.kind for s, info in complete.items()} == {2: "full", 4: "full", 5: "full"}
    assert (_CountingStager.made, _CountingStager.closed) == (1, 1)
    assert trainer.run.checkpointer.saver.stager is None
    save = ["staging waits for compute", "copy on staging", "staging synchronized", "save returned"]
    step = ["optimizer step"]
    assert _log == step * 2 + save + step * 2 + save + step + save, _log  # saves at steps 2, 4 and 5 (the last)
    assert len(buffers) == 3 and buffers[0] and buffers[1] == buffers[0] == buffers[2]
