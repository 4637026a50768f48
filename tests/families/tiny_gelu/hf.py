"""tiny_gelu in Hugging Face form: Llama's names and config fields, the MLP as up_proj/down_proj
with hidden_act "gelu" and intermediate_size = ffn_mult x dim."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.llama3 import hf as llama_hf
from torchtitan_amp.models.spec import HFAdapter

_MLP = {"feed_forward.w_in.weight": "mlp.up_proj.weight", "feed_forward.w_out.weight": "mlp.down_proj.weight"}
_OURS = re.compile(r"^layers\.(\d+)\.(feed_forward\..+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(mlp\..+)$")


def to_hf_name(fqn: str) -> str:
    if m := _OURS.match(fqn):
        return f"model.layers.{m[1]}.{_MLP[m[2]]}"
    return llama_hf.to_hf_name(fqn)


def from_hf_name(name: str) -> str | None:
    if m := _THEIRS.match(name):
        ours = {hf: o for o, hf in _MLP.items()}.get(m[2])
        return f"layers.{m[1]}.{ours}" if ours else None
    return llama_hf.from_hf_name(name)


def config_fields(cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
    if cfg.get("hidden_act") != "gelu":
        raise CheckpointError(f"{folder / 'config.json'}: 'hidden_act' = {cfg.get('hidden_act')!r}; "
                              "tiny_gelu supports only 'gelu'")
    return llama_hf.config_fields({**cfg, "hidden_act": "silu"}, folder)


def args_fields(args: Any) -> dict[str, Any]:
    return {**llama_hf.args_fields(args), "ffn_hidden": args.ffn_hidden}


def hf_config(args: Any, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    cfg = llama_hf.hf_config(args, dtype, bos_id, eos_id)
    return {**cfg, "hidden_act": "gelu", "intermediate_size": args.ffn_hidden}


ADAPTER = dataclasses.replace(llama_hf.ADAPTER, display_name="tiny_gelu", to_hf_name=to_hf_name,
                              from_hf_name=from_hf_name, config_fields=config_fields,
                              args_fields=args_fields, hf_config=hf_config)
assert isinstance(ADAPTER, HFAdapter)
