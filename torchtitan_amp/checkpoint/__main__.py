"""`python -m torchtitan_amp.checkpoint ...`: an old torch is one line, before torch is imported."""

import sys

from torchtitan_amp.environment import require

require()

from torchtitan_amp.checkpoint.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
