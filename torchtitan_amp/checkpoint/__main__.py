"""`python -m torchtitan_amp.checkpoint ...` (cli.cli checks the environment first)."""

from torchtitan_amp.checkpoint.cli import cli

cli()
