"""Entry point: `torchrun ... train.py --job.config_file FILE [--section.key VALUE ...]`
(torchtitan_amp/main.py; installed, also `torchtitan-amp-train` and `python -m torchtitan_amp`)."""

from torchtitan_amp.main import check_config, cli, main

__all__ = ["check_config", "main"]

if __name__ == "__main__":
    cli()
