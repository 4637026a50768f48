"""`python -m torchtitan_amp.checkpoint ...`: the environment is checked before torch is imported."""

from torchtitan_amp.environment import require

require()

from torchtitan_amp.checkpoint.cli import cli  # noqa: E402

cli()
