"""Inputs the tests share: the standard small training run and data made to exercise masking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# debugmodel_tiny: a bf16 step costs ~14x less than debugmodel's on a CPU that emulates bf16; the
# loss still falls visibly within a dozen steps at this learning rate (10 steps: 6.02 -> 4.56).
TINY = (
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
)


def mask_labels(labels: Any) -> Any:
    """The labels with some set to -100 (ignored by the loss), chosen by each window's own content
    so that every layout masks the same labels of the same window wherever it lands: by the sum of
    the window's labels mod 4, the whole window, its first half, every third label, or none. Ranks
    and micro-batches then hold unequal counts of valid labels, some none at all."""
    out = labels.clone()
    for row in out:
        kind = int(row.sum()) % 4
        if kind == 0:
            row[:] = -100
        elif kind == 1:
            row[: len(row) // 2] = -100
        elif kind == 2:
            row[::3] = -100
    return out


def write_short_documents(path: Path) -> Path:
    """A jsonl corpus of 400 documents of 1-6 words: every 32-token window packs several, so
    document masking (model.attn_mask_type = "block_causal") changes the loss."""
    import random

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = random.Random(0)
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))}) + "\n"
            for _ in range(400)
        )
    )
    return path
