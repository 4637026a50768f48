"""train.py with the test-only tiny_gelu family registered: `torchrun ... train_tiny_gelu.py
--model.name tiny_gelu --model.flavor tiny ...` (what a user's own entry point for a family would do)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.families`

from tests.families import tiny_gelu  # noqa: E402

tiny_gelu.register()

from torchtitan_amp.main import cli  # noqa: E402

if __name__ == "__main__":
    cli()
