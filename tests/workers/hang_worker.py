"""Rank 1 stops answering at step 3 (as if stuck or wedged); the others must not wait forever.

Usage: torchrun ... hang_worker.py [--section.key value ...] (train.py's command line)
"""

from __future__ import annotations

import os
import sys
import time

from torchtitan_amp.config import load_config
from torchtitan_amp.distributed import process_groups
from torchtitan_amp.train.trainer import Trainer

HANG_AT_STEP = 3


def main() -> None:
    trainer = Trainer(load_config(sys.argv[1:]))
    step_fn = trainer.train_step

    def train_step(batches):  # type: ignore[no-untyped-def]
        if int(os.environ["RANK"]) == 1 and trainer.step == HANG_AT_STEP:
            time.sleep(600)
        return step_fn(batches)

    trainer.train_step = train_step  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        process_groups.shutdown()


if __name__ == "__main__":
    main()
