"""Entry point: `torchrun ... train.py --job.config_file FILE [--section.key VALUE ...]`."""

from __future__ import annotations

import logging
import os
import sys


def _setup_logging() -> None:
    rank = os.environ.get("RANK")
    tag = f"[rank{rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tag}%(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)


def main(argv: list[str]) -> int:
    from torchtitan_amp.config import ConfigError, help_text, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    _setup_logging()
    from torchtitan_amp import distributed
    from torchtitan_amp.data import DataError
    from torchtitan_amp.trainer import Trainer

    try:
        trainer = Trainer(load_config(argv))
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    finally:
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
