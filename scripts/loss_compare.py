#!/usr/bin/env python3
"""`python scripts/loss_compare.py ARGS`: torchtitan_amp.tools.loss_compare (its docstring and
`--help` say what it does) on this checkout's package, from any folder, installed or not."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # A script's own folder is what Python puts on the import path, not the checkout holding the
    # package: the tool runs as a module, in this process's place, with the checkout on PYTHONPATH.
    checkout = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (checkout, os.environ.get("PYTHONPATH"))))}
    os.execve(sys.executable, [sys.executable, "-m", "torchtitan_amp.tools.loss_compare", *sys.argv[1:]], env)
