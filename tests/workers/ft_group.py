"""One rank of a torchft replica group (tests/test_fault_tolerance.py): trains as train.py does,
then writes OUT/rank{R}.json with the step it ended at, a digest of each parameter shard it holds
(to compare the groups' weights bit for bit), its token count and its loader's global position.

A group that trains alone (its peer was killed and has not rejoined yet) sleeps
FT_PACE_ALONE_S seconds after each step: on two busy cores a restarted group needs 10-30 s to
start, longer than a tiny model's remaining steps take, and the test is about its rejoining.

FT_KILL_DURING_ALLREDUCE=N: rank 0 SIGKILLs itself inside step N's second cross-group all-reduce,
after its peers have started it (the whole group then goes: torchrun ends the other rank);
FT_KILL_AT_CALL=K: at the K-th instead (1 under DiLoCo, whose sync is one all-reduce, after the
quorum: the peer waits for data that never comes).

FT_START_TOGETHER=DIR: the groups first launched together wait, their Managers made (heartbeating),
until every group has marked DIR: otherwise one group can still be importing torch when the other
asks for the first quorum, which the lighthouse then forms without it (after join_timeout_ms),
and the late group's first act is to heal.

Usage: ft_group.py OUT TRAIN_ARGS..."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.tensor import DTensor

from tests.support.launch import digest, exit_process
from torchtitan_amp.config import load_config
from torchtitan_amp.train.trainer import Trainer


def main() -> None:
    out = Path(sys.argv[1])
    config = load_config(sys.argv[2:])
    trainer = Trainer(config)
    if os.environ.get("FT_START_TOGETHER"):
        _start_together(Path(os.environ["FT_START_TOGETHER"]), config.fault_tolerance)
    pace, step = float(os.environ.get("FT_PACE_ALONE_S", "0")), trainer.train_step

    def paced_step(*args, **kwargs):
        result = step(*args, **kwargs)
        if trainer.run.ft.participants < config.fault_tolerance.group_size:
            time.sleep(pace)
        return result

    trainer.train_step = paced_step
    kill_at = int(os.environ.get("FT_KILL_DURING_ALLREDUCE", "0"))
    if kill_at and os.environ.get("RANK") == "0":
        allreduce, calls = trainer.run.ft.manager.allreduce, []
        kill_call = int(os.environ.get("FT_KILL_AT_CALL", "2"))

        def dying_allreduce(*args, **kwargs):
            calls.append(trainer.step)
            if calls.count(kill_at) == kill_call:
                os.kill(os.getpid(), signal.SIGKILL)
            return allreduce(*args, **kwargs)

        trainer.run.ft.manager.allreduce = dying_allreduce
    trainer.train()
    shards = {n: digest(p.to_local() if isinstance(p, DTensor) else p) for n, p in trainer.run.model.named_parameters()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps(
            {
                "step": trainer.step,
                "shards": shards,
                "tokens_seen": trainer.tokens_seen,
                "data_position": trainer.run.dataloader.state_dict()["position"],
            }
        )
    )
    exit_process(0)


def _start_together(folder: Path, ft, timeout_s: float = 120.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ready_g{ft.replica_id}_r{os.environ.get('RANK', '0')}").touch()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(any(folder.glob(f"ready_g{g}_r*")) for g in range(ft.group_size)):
            return
        time.sleep(0.1)


if __name__ == "__main__":
    main()
