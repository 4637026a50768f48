"""Datasets -> packed, data-parallel-sharded, resumable (inputs, labels) batches.

    pydoc / path:   text.py (read + tokenised in memory at start-up) -> packed.py
    chat:           chat.py (conversations rendered by chat_template.py, packed whole, assistant labels)
    tokens:         prepare.py (once, offline: sources.py -> shards + index.py) -> tokens.py (memmap)
    both            -> loader.py: ParallelAwareDataLoader, build_dataloader

`python -m torchtitan_amp.data prepare|merge|verify` is cli.py. The names below load lazily so that
the prepare command (and its worker processes) never import torch.
"""

from importlib import import_module
from typing import Any

from torchtitan_amp.core.errors import DataError

_EXPORTS = {
    "build_dataloader": "loader",
    "ParallelAwareDataLoader": "loader",
    "PackedTextDataset": "packed",
    "TokenWindowDataset": "tokens",
    "load_texts": "text",
    "tokenize_corpus": "text",
}

__all__ = ["DataError", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
