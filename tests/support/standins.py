"""Stand-ins for what the tests do not run for real: torchft's Manager, in-process (one replica
group whose peers hold the same values, or replica groups in threads that really average)."""

from __future__ import annotations

from typing import Any


class _Done:
    def wait(self) -> None:
        pass


class SameValuesManager:
    """torchft's Manager for one replica group run in-process, its peer group holding the same
    values: the all-reduce's average is the tensor itself (the dtypes sent are kept in `sent`),
    the quorum is immediate, every step commits, and this group saves the shared checkpoint."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def register_state_dict_fn(self, *args: Any) -> None:
        pass

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 0

    def should_commit(self) -> bool:
        return True

    def allreduce(self, t: Any, reduce_op: Any = None) -> _Done:
        """The average of equal values is the tensor itself; their sum (reduce_op SUM: the
        counts) is the tensor times the groups."""
        import torch.distributed as dist

        self.sent.append(t.dtype)
        if reduce_op == dist.ReduceOp.SUM:
            t.mul_(self.num_participants())
        return _Done()

    def shutdown(self, wait: bool = False) -> None:
        pass


def use_stand_in_manager(monkeypatch: Any) -> None:
    """Trainers built under `monkeypatch` run fault tolerance in-process against a SameValuesManager
    (no lighthouse), with a fixed peak FLOP/s (no matmul probe)."""
    from torchtitan_amp.train import build
    from torchtitan_amp.train.fault_tolerance import FaultTolerance

    monkeypatch.setattr(build, "peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(
        build.fault_tolerance,
        "build",
        lambda config, plan, *device: FaultTolerance(config.fault_tolerance, plan, manager=SameValuesManager()),
    )


def use_paired_managers(monkeypatch: Any, groups: PairedGroups) -> None:
    """As use_stand_in_manager, each trainer built with fault tolerance taking its replica
    group's PairedManager (one built without it has none)."""
    from torchtitan_amp.train import build
    from torchtitan_amp.train.fault_tolerance import FaultTolerance

    monkeypatch.setattr(build, "peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(
        build.fault_tolerance,
        "build",
        lambda config, plan, *device: (
            FaultTolerance(config.fault_tolerance, plan, manager=groups.managers[config.fault_tolerance.replica_id])
            if config.fault_tolerance.enable
            else None
        ),
    )


class PairedGroups:
    """Replica groups trained in-process, one thread each, whose torchft Managers really average:
    every all-reduce waits (a barrier) for the same call of every group, and each group gets the
    same result, summed in group order, then divided by the groups for an average (torchft's
    AVG: sum, then divide). `managers[g]` is group g's (a PairedManager); `run(fns)` runs fns[g]
    in group g's thread and returns their results."""

    def __init__(self, n: int = 2, timeout_s: float = 120.0) -> None:
        import threading

        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.managers = [PairedManager(self, g) for g in range(n)]

    def reduce(self, g: int, t: Any, average: bool) -> None:
        self.slots[g] = t.clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total += other
        self.barrier.wait()  # every group has read the slots before any writes the next call's
        t.copy_(total / self.n if average else total)

    def run(self, fns: list[Any]) -> list[Any]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.n) as pool:
            futures = [pool.submit(fn) for fn in fns]
            try:
                return [f.result() for f in futures]
            except BaseException:
                self.barrier.abort()  # a group that failed must not leave the other waiting
                raise


class PairedManager(SameValuesManager):
    """Group `g` of a PairedGroups: its all-reduces average (or sum) with the other groups';
    the state functions the loop registers are kept in `state_fns` (name -> (load, save)), so
    that a test can heal one group from another as torchft does over HTTP."""

    def __init__(self, groups: PairedGroups, g: int) -> None:
        super().__init__()
        self.groups, self.g = groups, g
        self.state_fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, name: str, load: Any, save: Any) -> None:
        self.state_fns[name] = (load, save)

    def num_participants(self) -> int:
        return self.groups.n

    def participating_rank(self) -> int:
        return self.g

    def allreduce(self, t: Any, reduce_op: Any = None) -> _Done:
        import torch.distributed as dist

        self.sent.append(t.dtype)
        self.groups.reduce(self.g, t, average=reduce_op in (None, dist.ReduceOp.AVG))
        return _Done()

    def heal_from(self, live: PairedManager) -> None:
        """Load every state the live group serves, as a healing group's quorum does."""
        for name, (load, _) in self.state_fns.items():
            load(live.state_fns[name][1]())
