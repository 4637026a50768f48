"""`python -m torchtitan_amp ...` (under torchrun: `torchrun ... -m torchtitan_amp ...`): train.py."""

from torchtitan_amp.main import cli

cli()
