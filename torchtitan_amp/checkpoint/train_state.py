"""The step and token count a checkpoint resumes at (PARTS' train_state entry). Its own module so
that saving and loading can make one without importing the manager that uses them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
