"""Worker behind tests/support/launch.run_distributed: one rank of a gloo group that runs one
module-level function.

    function.py MODULE:QUALNAME DIR    (as a rank of spawn_ranks: RANK, WORLD_SIZE, MASTER_ADDR/PORT)

Calls the function with the arguments pickled in DIR/args.pkl inside the default gloo group and
writes its return value, pickled, to DIR/rank{R}.out, or its traceback to DIR/rank{R}.err (exit 1).
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from tests.support.launch import exit_process


def main(ref: str, folder: Path) -> int:
    rank = int(os.environ["RANK"])
    try:
        module, _, name = ref.partition(":")
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        dist.init_process_group("gloo")
        out = pickle.dumps(fn(*pickle.loads((folder / "args.pkl").read_bytes())))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (folder / f"rank{rank}.err").write_text(traceback.format_exc())
        return 1
    (folder / f"rank{rank}.out").write_bytes(out)
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1], Path(sys.argv[2])))
