"""tiny_gelu in Hugging Face form: Llama's names and config fields, the MLP as up_proj/down_proj
with hidden_act "gelu" and intermediate_size = ffn_mult x dim. The adapter derives from Llama's
and changes only what differs: the MLP's names and three config methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.families.tiny_gelu.model import GeluArgs
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.llama3.hf import LAYER_NAMES, LlamaHFAdapter

_MLP = {"feed_forward.w_in.weight": "mlp.up_proj.weight", "feed_forward.w_out.weight": "mlp.down_proj.weight"}


class GeluHFAdapter(LlamaHFAdapter[GeluArgs]):
    display_name = "tiny_gelu"
    # Llama's attention and norms, this MLP's two projections (Llama's three have no place here).
    layer_names = {**{k: v for k, v in LAYER_NAMES.items() if not k.startswith("feed_forward.")}, **_MLP}

    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        if cfg.get("hidden_act") != "gelu":
            raise CheckpointError(
                f"{folder / 'config.json'}: 'hidden_act' = {cfg.get('hidden_act')!r}; tiny_gelu supports only 'gelu'"
            )
        return super().config_fields({**cfg, "hidden_act": "silu"}, folder)

    def args_fields(self, args: GeluArgs) -> dict[str, Any]:
        return {**super().args_fields(args), "ffn_hidden": args.ffn_hidden}

    def architecture_config(self, args: GeluArgs, dtype: str) -> dict[str, Any]:
        cfg = super().architecture_config(args, dtype)
        return {**cfg, "hidden_act": "gelu", "intermediate_size": args.ffn_hidden}


ADAPTER = GeluHFAdapter()
