"""The Hugging Face export the hf tests import from: a tiny random transformers model of one
family, built and saved here (no download). A module names its family's with `HF_EXPORT`, and
conftest.py's `hf` fixture saves it once per module."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HFExport:
    """transformers' `model` class (its name) built from `config()` under seed 0, saved in shards
    of at most `max_shard_size` with an index; `perturb_norms`: the norms moved off their initial
    ones first (where a wrong permutation of them cannot show); `own_shard`: the tensors whose names
    match this pattern moved into a shard of their own."""

    model: str
    config: Callable[[], Any]
    tokens: Any
    max_shard_size: str
    perturb_norms: bool = False
    own_shard: str | None = None


def save_hf_export(spec: HFExport, folder: Path) -> tuple[Path, Any, Any]:
    """(folder, model, reference logits of spec.tokens): sharded into several safetensors files with an index."""
    import torch
    import transformers

    from torchtitan_amp.checkpoint.hf import INDEX

    torch.manual_seed(0)
    model = getattr(transformers, spec.model)(spec.config()).eval()
    if spec.perturb_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=spec.max_shard_size)
    assert (folder / INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 2
    if spec.own_shard is not None:
        move_to_own_shard(folder, spec.own_shard)
    with torch.no_grad():
        return folder, model, model(spec.tokens).logits


def move_to_own_shard(folder: Path, pattern: str) -> None:
    """Move the tensors matching `pattern` into a shard of their own (transformers keeps a layer's
    experts together; other writers split them anywhere, and our reader must not care)."""
    from safetensors.torch import load_file, save_file

    from torchtitan_amp.checkpoint.hf import INDEX

    index = json.loads((folder / INDEX).read_text())
    moved = {}
    for shard in {v for k, v in index["weight_map"].items() if re.match(pattern, k)}:
        tensors = load_file(str(folder / shard))
        moved.update({k: v for k, v in tensors.items() if re.match(pattern, k)})
        save_file({k: v for k, v in tensors.items() if k not in moved}, str(folder / shard), metadata={"format": "pt"})
    save_file(moved, str(folder / "model-extra.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(moved, "model-extra.safetensors"))
    (folder / INDEX).write_text(json.dumps(index))
