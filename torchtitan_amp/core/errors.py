"""Every error a user can cause, and the exit code train.py and the tools give it.

A `UserError` is bad input (config, data, checkpoint, environment) named in one line: train.py
prints `error: <message>` on stderr and exits with code 2, before any process group exists where
the check needs none. A `NonFiniteError` is a run that diverged (exit code 1), a
`ReplicaGroupGaveUp` a fault-tolerant replica group out of retries (exit code 1). Anything else is
a crash with its traceback. No torch import: the config loader uses these.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input; the message is a single line meant for the user."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # User input (a stray "--x=\n", a file name) can carry newlines into the message.
        super().__init__(" ".join(str(message).splitlines()))


class ConfigError(UserError):
    """A bad job config: a field, its value and what is allowed."""


class PrecisionError(ConfigError):
    """A precision setting that cannot be honoured: raised at config time, never a fallback."""


class DataError(UserError):
    """A dataset, tokenizer file or data config that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used or written."""


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became inf/nan outside fp16 loss scaling."""

    exit_code = 1


class ReplicaGroupGaveUp(RuntimeError):
    """A fault-tolerant replica group failed to commit fault_tolerance.max_retries + 1 steps in a
    row: it exits (code 1) so that its launcher restarts it, and it heals from a live group."""

    exit_code = 1
