"""The Qwen3 family's Hugging Face adapter: transformers' Qwen3ForCausalLM (model_type "qwen3") in
the published layout, config.json's fields in both directions (checkpoint/hf.py does the reading,
writing and permuting for every family).

Llama's names and rotary permutation (our interleaved pairs against HF's halves, on the q and k
projections' rows), plus Qwen3's q_norm / k_norm, whose weights scale the elements of one head and
so are permuted like a one-head block. What differs in config.json: an explicit head_dim, the MLP
width as intermediate_size, rope theta without scaling, and no sliding window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.llama3.hf import LAYER_NAMES, LlamaHFAdapter, rope_settings
from torchtitan_amp.models.qwen3.model import Qwen3ModelArgs

CONFIG = "config.json"

_LAYER_NAMES = {
    **LAYER_NAMES,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}

# config.json's name for each model-args field, for the error message.
_HF_FIELD = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "ffn_hidden": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "use_scaled_rope": "rope_scaling",
    "enable_weight_tying": "tie_word_embeddings",
}


def _check_supported(cfg: dict[str, Any], where: Path) -> None:
    """Another architecture, biases, another activation, a sliding window or rope scaling: one line."""
    if cfg.get("model_type", "qwen3") != "qwen3":
        raise CheckpointError(f"{where}: 'model_type' = {cfg['model_type']!r}; only 'qwen3' can be loaded")
    for field, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        if cfg.get(field, allowed) != allowed:
            raise CheckpointError(f"{where}: '{field}' = {cfg[field]!r}; this model supports only {allowed!r}")
    _, scaling = rope_settings(cfg)
    if scaling is not None:
        raise CheckpointError(
            f"{where}: rope scaling type {scaling['rope_type']!r} is not supported for Qwen3 (allowed: none)"
        )


class Qwen3HFAdapter(LlamaHFAdapter[Qwen3ModelArgs]):
    """Qwen3ForCausalLM: Llama's names with the q/k norms, and Qwen3's config.json."""

    display_name = "Qwen3"
    field_names = _HF_FIELD
    layer_names = _LAYER_NAMES

    def rotary_heads(self, fqn: str, args: Qwen3ModelArgs) -> int | None:
        """The head count of a tensor whose rows the two rotary layouts order differently: the q and
        k projections, and the q / k norms (one head's elements, so one head)."""
        if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1
        return super().rotary_heads(fqn, args)

    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The config.json fields this model reads, in model-args terms; CheckpointError for a config
        this model cannot represent (another architecture, biases, sliding window, rope scaling)."""
        where = folder / CONFIG

        def need(field: str) -> Any:
            if field not in cfg:
                raise CheckpointError(f"{where} has no '{field}'")
            return cfg[field]

        _check_supported(cfg, where)
        dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        theta, _ = rope_settings(cfg)
        return {
            "dim": dim,
            "n_layers": int(need("num_hidden_layers")),
            "n_heads": n_heads,
            "kv_heads": int(cfg.get("num_key_value_heads") or n_heads),
            "head_dim": int(cfg.get("head_dim") or dim // n_heads),
            "vocab_size": int(need("vocab_size")),
            "ffn_hidden": int(need("intermediate_size")),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "use_scaled_rope": False,
            # transformers' default when the field is absent
            "enable_weight_tying": bool(cfg.get("tie_word_embeddings", False)),
        }

    def args_fields(self, args: Qwen3ModelArgs) -> dict[str, Any]:
        """The same fields as config_fields, from our model args; tying compared one way, as Llama's
        (an untied model can start from a tied folder, not the other way)."""
        fields = {
            "dim": args.dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "ffn_hidden": args.ffn_hidden,
            "norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "use_scaled_rope": args.use_scaled_rope,
        }
        if args.enable_weight_tying:
            fields["enable_weight_tying"] = True
        return fields

    def architecture_config(self, args: Qwen3ModelArgs, dtype: str) -> dict[str, Any]:
        """config.json for `args`, in the published Qwen3 spelling (rope_theta, rope_scaling null),
        which transformers 4.51+ and inference servers read."""
        if args.use_scaled_rope:
            raise CheckpointError(
                "model args use_scaled_rope = True, but Qwen3 has no llama3 rope scaling; "
                "this model cannot be exported as Qwen3ForCausalLM"
            )
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": args.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "tie_word_embeddings": args.enable_weight_tying,
            "torch_dtype": dtype,
        }
        return cfg

    def describe(self, key: str, value: Any) -> Any:
        """A config value as config.json spells it, for an error message (rope scaling is a type)."""
        return ("none" if not value else "scaled") if key == "use_scaled_rope" else value


ADAPTER = Qwen3HFAdapter()
