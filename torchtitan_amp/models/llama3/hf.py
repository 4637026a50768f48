"""Llama 3's Hugging Face adapter: LlamaForCausalLM's tensor names, which tensors the two rotary
layouts order differently, and config.json's fields in both directions (checkpoint/hf.py does the
reading, writing and permuting for every family).

This model rotates interleaved pairs (x[2i], x[2i+1]) (Meta's layout), Hugging Face's
LlamaForCausalLM rotates halves (x[i], x[i + head_dim/2]): the q and k projections' output rows are
permuted within each head on the way in and out; nothing else changes but the names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.llama3.model import LlamaModelArgs, ffn_hidden_dim
from torchtitan_amp.models.spec import HFAdapter

CONFIG = "config.json"
LlamaArgsT = TypeVar("LlamaArgsT", bound=LlamaModelArgs)  # Llama's args or a family's that extend them

# Our FQN inside layers.<i>. -> HF's inside model.layers.<i> (the MoE family's table extends it).
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Older exports carry the rotary tables as a buffer; we compute ours from config.json.
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def layer_mapped_name(fqn: str, layer_names: dict[str, str], top_names: dict[str, str]) -> str:
    """Our FQN -> the HF name, through a family's table of a layer's tensors and of the others
    (the HF layout every decoder here shares: model.layers.N.<name>).

    Args:
        fqn: our parameter name (layers.N.<name> or a top-level one).
        layer_names: a layer tensor's name in our model -> its HF name inside model.layers.N.
        top_names: the names outside the layers (embedding, final norm, output head) -> their HF
            names.
    """
    if m := _OUR_LAYER.match(fqn):
        return f"model.layers.{m[1]}.{layer_names[m[2]]}"
    return top_names[fqn]


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, llama3 scaling or None) from either spelling: `rope_theta` + `rope_scaling`
    (published configs, transformers < 5) or `rope_parameters` (transformers >= 5)."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return float(theta), (None if kind == "default" else {**scaling, "rope_type": kind})


# config.json's name for each model-args field, for the error message.
_HF_FIELD = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_hidden": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "use_scaled_rope": "rope_scaling",
    "rope_scaling_factor": "rope_scaling.factor",
    "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_original_max_position": "rope_scaling.original_max_position_embeddings",
    "enable_weight_tying": "tie_word_embeddings",
}


class LlamaHFAdapter(HFAdapter[LlamaArgsT]):
    """LlamaForCausalLM. A family whose checkpoints are Llama's with other tensors (the MoE family's
    Qwen3-MoE) derives from it and changes `layer_names` and the methods that differ."""

    display_name = "Llama"
    ignored = IGNORED
    field_names = _HF_FIELD
    # Our FQN inside layers.<i>. -> HF's inside model.layers.<i>.; the other tensors'.
    layer_names: ClassVar[dict[str, str]] = LAYER_NAMES
    top_names: ClassVar[dict[str, str]] = TOP_NAMES

    def to_hf_name(self, fqn: str) -> str:
        return layer_mapped_name(fqn, self.layer_names, self.top_names)

    def from_hf_name(self, name: str) -> str | None:
        """Our FQN for a Hugging Face tensor name, or None for one this model has no place for."""
        if m := _HF_LAYER.match(name):
            ours = {hf: o for o, hf in self.layer_names.items()}.get(m[2])
            return f"layers.{m[1]}.{ours}" if ours else None
        return {hf: o for o, hf in self.top_names.items()}.get(name)

    def rotary_heads(self, fqn: str, args: LlamaArgsT) -> int | None:
        """The head count of a q or k projection, whose rows the two rotary layouts order differently."""
        if fqn.endswith("attention.wq.weight"):
            return args.n_heads
        if fqn.endswith("attention.wk.weight"):
            return args.kv_heads
        return None

    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The config.json fields this model reads, in model-args terms; CheckpointError for a
        config this model cannot represent (another architecture, biases, another rope type)."""
        where = folder / CONFIG

        def need(field: str) -> Any:
            if field not in cfg:
                raise CheckpointError(f"{where} has no '{field}'")
            return cfg[field]

        if cfg.get("model_type", "llama") != "llama":
            raise CheckpointError(f"{where}: 'model_type' = {cfg['model_type']!r}; only 'llama' can be loaded")
        for field, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if cfg.get(field, allowed) != allowed:
                raise CheckpointError(f"{where}: '{field}' = {cfg[field]!r}; this model supports only {allowed!r}")
        dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        if cfg.get("head_dim") not in (None, dim // n_heads):
            raise CheckpointError(
                f"{where}: 'head_dim' = {cfg['head_dim']} but hidden_size / num_attention_heads "
                f"= {dim // n_heads}; this model supports only the latter"
            )
        theta, scaling = rope_settings(cfg)
        fields = {
            "dim": dim,
            "n_layers": int(need("num_hidden_layers")),
            "n_heads": n_heads,
            "kv_heads": int(cfg.get("num_key_value_heads") or n_heads),
            "vocab_size": int(need("vocab_size")),
            "ffn_hidden": int(need("intermediate_size")),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "use_scaled_rope": scaling is not None,
            # transformers' default when the field is absent
            "enable_weight_tying": bool(cfg.get("tie_word_embeddings", False)),
        }
        if scaling is not None:
            if scaling["rope_type"] != "llama3":
                raise CheckpointError(
                    f"{where}: rope scaling type {scaling['rope_type']!r} is not supported (allowed: 'llama3', or none)"
                )
            fields.update(
                rope_scaling_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling["low_freq_factor"]),
                rope_high_freq_factor=float(scaling["high_freq_factor"]),
                rope_original_max_position=int(scaling["original_max_position_embeddings"]),
            )
        return fields

    def args_fields(self, args: LlamaArgsT) -> dict[str, Any]:
        """The same fields as config_fields, from our model args. Tying is compared one way only: a
        tied model cannot hold a folder's two different matrices, but an untied one can start from a
        tied folder (its output layer begins as a copy of the embeddings: checkpoint/hf.HFReader)."""
        fields = {
            "dim": args.dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "kv_heads": args.kv_heads,
            "vocab_size": args.vocab_size,
            "ffn_hidden": ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
            "norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "use_scaled_rope": args.use_scaled_rope,
        }
        if args.enable_weight_tying:
            fields["enable_weight_tying"] = True
        if args.use_scaled_rope:
            fields.update(
                rope_scaling_factor=args.rope_scaling_factor,
                rope_low_freq_factor=args.rope_low_freq_factor,
                rope_high_freq_factor=args.rope_high_freq_factor,
                rope_original_max_position=args.rope_original_max_position,
            )
        return fields

    def architecture_config(self, args: LlamaArgsT, dtype: str) -> dict[str, Any]:
        """config.json for `args`, in the long-standing spelling (rope_theta + rope_scaling) that every
        transformers version and inference server reads. A tied model says so (tie_word_embeddings)
        and, like Hugging Face's tied checkpoints, has no lm_head.weight."""
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args.dim,
            "intermediate_size": ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
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
            "mlp_bias": False,
            "tie_word_embeddings": args.enable_weight_tying,
            "torch_dtype": dtype,
        }
        if args.use_scaled_rope:
            cfg["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": args.rope_scaling_factor,
                "low_freq_factor": args.rope_low_freq_factor,
                "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_position,
            }
            # The context the scaling was made for, if longer than what this run trained on.
            cfg["max_position_embeddings"] = max(
                args.max_seq_len, int(args.rope_original_max_position * args.rope_scaling_factor)
            )
        return cfg

    def describe(self, key: str, value: Any) -> Any:
        """A config value as config.json spells it, for an error message (rope scaling is a type)."""
        return ("llama3" if value else "none") if key == "use_scaled_rope" else value


ADAPTER: LlamaHFAdapter[LlamaModelArgs] = LlamaHFAdapter()
