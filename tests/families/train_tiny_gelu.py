"""train.py with the test-only tiny_gelu family registered (what a user's own entry point for a
family would do). From the repo root: `torchrun ... -m tests.families.train_tiny_gelu --model.name
tiny_gelu --model.flavor tiny ...`, or the file's path with the repo root on PYTHONPATH (as
tests/support/launch.run_train launches it)."""

from tests.families import tiny_gelu
from torchtitan_amp.main import cli

tiny_gelu.register()

if __name__ == "__main__":
    cli()
