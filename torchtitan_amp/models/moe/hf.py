"""The MoE family's Hugging Face adapter: transformers' Qwen3MoeForCausalLM (model_type
"qwen3_moe") in the published layout, config.json's fields in both directions (checkpoint/hf.py
does the reading, writing, stacking and permuting for every family). docs/moe_hf.md has the table.

What differs from Llama's names: Qwen3's q_norm / k_norm scale the elements of a head, which the
two rotary layouts order differently, so their weights are permuted like a one-head q row block;
the router is `mlp.gate`; the experts are stored one nn.Linear per expert
(`mlp.experts.E.gate_proj.weight` [hidden, dim]) where ours are three stacked [E, dim, hidden]
weights used as x @ w, so each of ours is E transposed HF tensors; the expert bias of our
bias balancing has no Qwen3 counterpart (zero means none).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.llama3.hf import LAYER_NAMES, LlamaHFAdapter, rope_settings
from torchtitan_amp.models.moe.model import MoEModelArgs

CONFIG = "config.json"

# Our FQN inside layers.<i>. -> HF's inside model.layers.<i>: Llama's (its feed_forward.w* are the
# dense blocks, Qwen3's mlp_only_layers), plus Qwen3's q/k norms and the router.
_LAYER_NAMES = {
    **LAYER_NAMES,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.router.weight": "mlp.gate.weight",
}
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|down_proj|up_proj)\.weight$")
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
EXPERT_BIAS = re.compile(r"\.feed_forward\.router\.expert_bias$")


def _dense_layers(cfg: dict[str, Any], n_layers: int, where: Path) -> int:
    """Qwen3-MoE's dense blocks (mlp_only_layers, decoder_sparse_step) as our n_dense_layers: only a
    leading run of dense blocks is representable."""
    only = sorted(int(i) for i in cfg.get("mlp_only_layers") or [])
    if only != list(range(len(only))):
        raise CheckpointError(
            f"{where}: 'mlp_only_layers' = {only}; only the first layers can be dense (model.n_dense_layers)"
        )
    step = int(cfg.get("decoder_sparse_step", 1))
    if step != 1 and len(only) < n_layers:
        raise CheckpointError(
            f"{where}: 'decoder_sparse_step' = {step}; only 1 (every block after the dense ones is MoE) is supported"
        )
    return len(only)


def _check_supported(cfg: dict[str, Any], where: Path) -> None:
    if cfg.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise CheckpointError(f"{where}: 'model_type' = {cfg['model_type']!r}; only 'qwen3_moe' can be loaded")
    for field, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        if cfg.get(field, allowed) != allowed:
            raise CheckpointError(f"{where}: '{field}' = {cfg[field]!r}; this model supports only {allowed!r}")
    if int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0) <= 0:
        raise CheckpointError(f"{where}: 'num_experts' is missing or 0; a Qwen3-MoE model needs experts")


# config.json's name for each model-args field, for the error message.
_HF_FIELD = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "use_scaled_rope": "rope_scaling",
    "qk_norm": "q_norm/k_norm (always in Qwen3-MoE)",
    "n_routed_experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "route_norm": "norm_topk_prob",
    "score_func": "router scores (softmax in Qwen3-MoE)",
    "route_scale": "routed scaling (1.0 in Qwen3-MoE)",
    "n_shared_experts": "shared experts (none in Qwen3-MoE)",
    "n_dense_layers": "mlp_only_layers",
    "dense_hidden": "intermediate_size",
}


def _check_exportable(args: MoEModelArgs) -> None:
    """What a Qwen3-MoE config cannot say, refused by field before anything is written."""
    for field, allowed, why in (
        ("n_shared_experts", 0, "has no shared expert"),
        ("score_func", "softmax", "routes on softmax scores"),
        ("route_scale", 1.0, "does not scale its combine weights"),
        ("qk_norm", True, "always normalises q and k per head"),
        ("use_scaled_rope", False, "has no llama3 rope scaling"),
    ):
        if getattr(args, field) != allowed:
            raise CheckpointError(
                f"model args {field} = {getattr(args, field)!r}, but Qwen3-MoE {why}; "
                "this model cannot be exported as Qwen3MoeForCausalLM"
            )


class Qwen3MoeHFAdapter(LlamaHFAdapter[MoEModelArgs]):
    """Qwen3MoeForCausalLM: Llama's names (its table extended), each expert stored on its own, and
    Qwen3-MoE's config.json."""

    display_name = "Qwen3-MoE"
    field_names = _HF_FIELD
    zero_in_hf = EXPERT_BIAS
    layer_names = _LAYER_NAMES

    def from_hf_name(self, name: str) -> str | None:
        """Our FQN for a Hugging Face tensor name (each expert's part names the stacked tensor it
        belongs to), or None for one this model has no place for."""
        if m := _HF_EXPERT.match(name):
            ours = {hf: w for w, hf in _EXPERT_NAMES.items()}[m[2]]
            return f"layers.{m[1]}.feed_forward.experts.{ours}"
        return super().from_hf_name(name)

    def stacked(self, fqn: str, args: MoEModelArgs) -> tuple[list[str], bool] | None:
        """Our [E, dim, hidden] (w1, w3) or [E, hidden, dim] (w2) expert weight is applied as x @ w,
        HF's per-expert nn.Linear weight as x @ w.T: each expert's HF tensor is our slice transposed."""
        if not (m := _OUR_EXPERTS.match(fqn)):
            return None
        proj = _EXPERT_NAMES[m[2]]
        names = [f"model.layers.{m[1]}.mlp.experts.{e}.{proj}.weight" for e in range(args.n_routed_experts)]
        return names, True

    def rotary_heads(self, fqn: str, args: MoEModelArgs) -> int | None:
        """The head count of a tensor whose rows the two rotary layouts order differently: Llama's q
        and k projections, and the q / k norms (one head's elements, so one head)."""
        if fqn.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1
        return super().rotary_heads(fqn, args)

    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The config.json fields this model reads, in model-args terms; CheckpointError for a config
        this model cannot represent (another architecture, biases, sliding window, dense blocks that
        are not a prefix, rope scaling). Qwen3-MoE always has QK-norm, softmax routing without a
        scale, and no shared expert: those are fields too, so a flavor without them is named."""
        where = folder / CONFIG

        def need(field: str) -> Any:
            if field not in cfg:
                raise CheckpointError(f"{where} has no '{field}'")
            return cfg[field]

        _check_supported(cfg, where)
        dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        n_layers = int(need("num_hidden_layers"))
        theta, scaling = rope_settings(cfg)
        if scaling is not None:
            raise CheckpointError(
                f"{where}: rope scaling type {scaling['rope_type']!r} is not supported for Qwen3-MoE (allowed: none)"
            )
        n_dense = _dense_layers(cfg, n_layers, where)
        fields = {
            "dim": dim,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "kv_heads": int(cfg.get("num_key_value_heads") or n_heads),
            "head_dim": int(cfg.get("head_dim") or dim // n_heads),
            "vocab_size": int(need("vocab_size")),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "use_scaled_rope": False,
            "qk_norm": True,
            "n_routed_experts": int(need("num_experts" if "num_experts" in cfg else "num_local_experts")),
            "top_k": int(need("num_experts_per_tok")),
            "moe_inter_dim": int(need("moe_intermediate_size")),
            "route_norm": bool(cfg.get("norm_topk_prob", False)),
            "score_func": "softmax",
            "route_scale": 1.0,
            "n_shared_experts": 0,
            "n_dense_layers": n_dense,
        }
        if n_dense:
            fields["dense_hidden"] = int(need("intermediate_size"))
        return fields

    def args_fields(self, args: MoEModelArgs) -> dict[str, Any]:
        """The same fields as config_fields, from our model args (the dense width only where there are
        dense blocks: Qwen3-MoE configs carry an unused intermediate_size otherwise)."""
        fields = {
            "dim": args.dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "use_scaled_rope": args.use_scaled_rope,
            "qk_norm": args.qk_norm,
            "n_routed_experts": args.n_routed_experts,
            "top_k": args.top_k,
            "moe_inter_dim": args.moe_inter_dim,
            "route_norm": args.route_norm,
            "score_func": args.score_func,
            "route_scale": args.route_scale,
            "n_shared_experts": args.n_shared_experts,
            "n_dense_layers": args.n_dense_layers,
        }
        if args.n_dense_layers:
            fields["dense_hidden"] = args.dense_hidden
        return fields

    def architecture_config(self, args: MoEModelArgs, dtype: str) -> dict[str, Any]:
        """config.json for `args`, in the published Qwen3-MoE spelling (num_experts, rope_theta), which
        transformers 4.51+ and inference servers read; tie_word_embeddings as the args say."""
        _check_exportable(args)
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": args.dim,
            "intermediate_size": args.dense_hidden,
            "moe_intermediate_size": args.moe_inter_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "num_experts": args.n_routed_experts,
            "num_experts_per_tok": args.top_k,
            "norm_topk_prob": args.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(args.n_dense_layers)),
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
        """A config value as config.json spells it, for an error message."""
        if key == "n_dense_layers" and value is not None:
            return list(range(value))
        return ("none" if not value else "scaled") if key == "use_scaled_rope" else value


ADAPTER = Qwen3MoeHFAdapter()
