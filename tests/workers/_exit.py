"""Ending a worker process the way train.py does: flush, then skip interpreter finalization,
where gloo's worker threads can abort a finished process ("terminate called without an active
exception", pytorch/pytorch#179291's failure mode)."""

from __future__ import annotations

import logging
import os
import sys


def exit_process(code: int | None) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
