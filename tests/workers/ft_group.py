"""One rank of a torchft replica group (tests/test_fault_tolerance.py): trains as train.py does,
then writes OUT/rank{R}.json with the step it ended at and a digest of each parameter shard it
holds, so that the test can compare the groups' weights bit for bit.

Usage: ft_group.py OUT TRAIN_ARGS..."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

from tests.support import digest, exit_process
from torchtitan_amp.config import load_config
from torchtitan_amp.train.trainer import Trainer


def main() -> None:
    out = Path(sys.argv[1])
    trainer = Trainer(load_config(sys.argv[2:]))
    trainer.train()
    shards = {n: digest(p.to_local() if isinstance(p, DTensor) else p) for n, p in trainer.model.named_parameters()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps({"step": trainer.step, "shards": shards}))
    exit_process(0)


if __name__ == "__main__":
    main()
