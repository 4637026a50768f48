"""train.py with every train step slowed down, for tests/test_checkpoint.py (pre-emption through the launcher).

Usage: [torchrun | python -m torchtitan_amp.launch ...] slow_steps.py SECONDS [train.py arguments]

Sleeps SECONDS after each train step, so a stop signal lands in a step that outlasts torchrun's
shutdown grace without a larger model. The sleep changes no number: a slowed run's metrics equal
an unslowed one's. Everything else is train.py's own code path (torchtitan_amp.main.main).
"""

from __future__ import annotations

import sys
import time

from tests.support.launch import exit_process
from torchtitan_amp import main as entry
from torchtitan_amp.train import build as train_build
from torchtitan_amp.train import trainer as trainer_module


def slow_down(seconds: float) -> None:
    original = trainer_module.Trainer.train_step

    def slow_step(self, batches):  # type: ignore[no-untyped-def]
        out = original(self, batches)
        time.sleep(seconds)
        return out

    trainer_module.Trainer.train_step = slow_step


if __name__ == "__main__":
    slow_down(float(sys.argv[1]))
    # MFU's CPU peak measurement (a matmul benchmark per dtype) is not what this test is about.
    train_build.peak_flops = lambda device, dtype: 1e12
    exit_process(entry.main(sys.argv[2:]))
