"""DeepSeek-V3's Hugging Face adapter: transformers' DeepseekV3ForCausalLM (model_type
"deepseek_v3") in the published layout (each expert its own tensors, as transformers saves them),
config.json's fields in both directions (checkpoint/hf.py does the reading, writing and stacking).

Names: MLA's projections and latent norms (q_a_proj, q_a_layernorm, q_b_proj or q_proj;
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj), the router `mlp.gate` with its
`e_score_correction_bias` (our expert bias: the same tensor, so it is read and written), the
shared experts `mlp.shared_experts.*`, and the experts as the MoE family's Qwen3-MoE adapter
stacks them. No rows are permuted: the published weights are in transformers' `rope_interleave`
layout, which is ours (a folder with rope_interleave false is refused).

Multi-token prediction (num_nextn_predict_layers, our mtp_depth): depth k is HF's layer
num_hidden_layers + k - 1 and our `mtp.{that number}`: `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` (our `norm`) and the block's tensors under the usual names. HF also stores the
embedding and output head there (`embed_tokens`, `shared_head.head`): ours are the main model's,
so an import skips them and an export writes the main model's there. Reading goes through
`derived` (a layer number past num_hidden_layers is an MTP module only given the args).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.llama3.hf import IGNORED, LAYER_NAMES, rope_settings
from torchtitan_amp.models.moe.hf import _EXPERT_NAMES, Qwen3MoeHFAdapter
from torchtitan_amp.models.spec import Derived

CONFIG = "config.json"

_LAYER_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if not k.startswith("attention.")},
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
}

# A multi-token prediction module's own tensors (its block's are _LAYER_NAMES').
_MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_OUR_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_OUR_MTP_EXPERTS = re.compile(r"^mtp\.(\d+)\.block\.feed_forward\.experts\.(w[123])$")
_IGNORED = re.compile(rf"{IGNORED.pattern}|^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


def _one(name: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    return lambda tensors: tensors[name]


def _experts(names: list[str]) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    return lambda tensors: torch.stack([tensors[n].T for n in names])


# config.json's name for each model-args field, for the error message.
_HF_FIELD = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "dense_hidden": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_routed_experts": "n_routed_experts",
    "top_k": "num_experts_per_tok",
    "n_shared_experts": "n_shared_experts",
    "n_dense_layers": "first_k_dense_replace",
    "route_norm": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "rope_factor": "rope_scaling.factor",
    "rope_original_seq_len": "rope_scaling.original_max_position_embeddings",
    "beta_fast": "rope_scaling.beta_fast",
    "beta_slow": "rope_scaling.beta_slow",
    "mscale": "rope_scaling.mscale",
    "mscale_all_dim": "rope_scaling.mscale_all_dim",
    "enable_weight_tying": "tie_word_embeddings",
    "mtp_depth": "num_nextn_predict_layers",
}
_ALLOWED = (
    ("hidden_act", "silu"),
    ("attention_bias", False),
    ("rope_interleave", True),
    ("scoring_func", "sigmoid"),
    ("topk_method", "noaux_tc"),
)


def _yarn_fields(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """rope_scaling (either spelling) as our YaRN fields; CheckpointError for another scaling."""
    _, scaling = rope_settings(cfg)
    if scaling is None:
        return {"rope_factor": 1.0}
    if scaling["rope_type"] != "yarn":
        raise CheckpointError(
            f"{where}: rope scaling type {scaling['rope_type']!r} is not supported (allowed: 'yarn', or none)"
        )
    for field, allowed in (("attention_factor", None), ("truncate", True)):
        if scaling.get(field, allowed) != allowed:
            raise CheckpointError(f"{where}: rope_scaling '{field}' = {scaling[field]!r} is not supported")
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or cfg["max_position_embeddings"] / original
    return {
        "rope_factor": float(factor),
        "rope_original_seq_len": original,
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "mscale": float(scaling.get("mscale") or 0),
        "mscale_all_dim": float(scaling.get("mscale_all_dim") or 0),
    }


class DeepSeekV3HFAdapter(Qwen3MoeHFAdapter):
    """DeepseekV3ForCausalLM: the Qwen3-MoE adapter's expert stacking with DeepSeek-V3's names
    and config.json (its methods take DeepSeekV3Args, typed Any: the base types MoEModelArgs)."""

    display_name = "DeepSeek-V3"
    field_names = _HF_FIELD
    zero_in_hf = None  # type: ignore[assignment]  # the expert bias is e_score_correction_bias
    layer_names = _LAYER_NAMES
    ignored = _IGNORED

    def to_hf_name(self, fqn: str) -> str:
        """Our FQN -> its HF name; an MTP module's tensors in its HF layer."""
        if m := _OUR_MTP.match(fqn):
            rest = m[2]
            inner = _MTP_NAMES[rest] if rest in _MTP_NAMES else _LAYER_NAMES[rest.removeprefix("block.")]
            return f"model.layers.{m[1]}.{inner}"
        return super().to_hf_name(fqn)

    def stacked(self, fqn: str, args: Any) -> tuple[list[str], bool] | None:
        """The experts of the layers and of an MTP module's block, each expert its HF tensor."""
        if m := _OUR_MTP_EXPERTS.match(fqn):
            proj = _EXPERT_NAMES[m[2]]
            return [f"model.layers.{m[1]}.mlp.experts.{e}.{proj}.weight" for e in range(args.n_routed_experts)], True
        return super().stacked(fqn, args)

    def derived(self, args: Any) -> dict[str, Derived]:
        """Every tensor an MTP module may have, read from its HF layer as it is (experts stacked);
        those a folder lacks are left to the model-fits check."""
        out: dict[str, Derived] = {}
        for i in range(args.n_layers, args.n_layers + args.mtp_depth):
            names = {**_MTP_NAMES, **{f"block.{k}": v for k, v in _LAYER_NAMES.items()}}
            for ours, theirs in names.items():
                source = f"model.layers.{i}.{theirs}"
                out[f"mtp.{i}.{ours}"] = Derived((source,), _one(source))
            for w, proj in _EXPERT_NAMES.items():
                parts = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(args.n_routed_experts)]
                out[f"mtp.{i}.block.feed_forward.experts.{w}"] = Derived(tuple(parts), _experts(parts))
        return out

    def copies(self, fqn: str, args: Any) -> list[str]:
        """The embedding and output head again in every MTP module's HF layer, as HF lays them out
        (a tied output head is the embedding, so the embedding goes to both places)."""
        inner = {"tok_embeddings.weight": ["embed_tokens.weight"], "output.weight": ["shared_head.head.weight"]}
        names = inner.get(fqn, [])
        if fqn == "tok_embeddings.weight" and args.enable_weight_tying:
            names = [*names, "shared_head.head.weight"]
        return [f"model.layers.{i}.{n}" for i in range(args.n_layers, args.n_layers + args.mtp_depth) for n in names]

    def rotary_heads(self, fqn: str, args: Any) -> int | None:
        """None: the interleaved rotary layout is HF's too (rope_interleave)."""
        return None

    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The config.json fields this model reads, in model-args terms; CheckpointError for a
        config it cannot represent (another architecture, biases, rotate-half rotary, softmax
        routing, another rope scaling)."""
        where = folder / CONFIG

        def need(field: str) -> Any:
            if field not in cfg:
                raise CheckpointError(f"{where} has no '{field}'")
            return cfg[field]

        if cfg.get("model_type", "deepseek_v3") != "deepseek_v3":
            raise CheckpointError(f"{where}: 'model_type' = {cfg['model_type']!r}; only 'deepseek_v3' can be loaded")
        for field, allowed in _ALLOWED:
            if cfg.get(field, allowed) != allowed:
                raise CheckpointError(f"{where}: '{field}' = {cfg[field]!r}; this model supports only {allowed!r}")
        n_dense = int(cfg.get("first_k_dense_replace") or 0)
        fields = {
            "dim": int(need("hidden_size")),
            "n_layers": int(need("num_hidden_layers")),
            "n_heads": int(need("num_attention_heads")),
            "vocab_size": int(need("vocab_size")),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": rope_settings(cfg)[0],
            "moe_inter_dim": int(need("moe_intermediate_size")),
            "n_routed_experts": int(need("n_routed_experts")),
            "top_k": int(need("num_experts_per_tok")),
            "n_shared_experts": int(cfg.get("n_shared_experts") or 0),
            "n_dense_layers": n_dense,
            "route_norm": bool(cfg.get("norm_topk_prob", True)),
            "route_scale": float(cfg.get("routed_scaling_factor", 1.0)),
            "score_func": "sigmoid",
            "n_group": int(cfg.get("n_group") or 1),
            "topk_group": int(cfg.get("topk_group") or 1),
            "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
            "kv_lora_rank": int(need("kv_lora_rank")),
            "qk_nope_head_dim": int(need("qk_nope_head_dim")),
            "qk_rope_head_dim": int(need("qk_rope_head_dim")),
            "v_head_dim": int(need("v_head_dim")),
            "enable_weight_tying": bool(cfg.get("tie_word_embeddings", False)),
            "mtp_depth": int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0),
            **_yarn_fields(cfg, where),
        }
        if n_dense:
            fields["dense_hidden"] = int(need("intermediate_size"))
        return fields

    def args_fields(self, args: Any) -> dict[str, Any]:
        """The same fields as config_fields, from our model args (YaRN's only when scaled, the
        dense width only where there are dense blocks)."""
        names = [k for k in _HF_FIELD if k not in ("dense_hidden", "enable_weight_tying")]
        if args.rope_factor <= 1:
            names = [k for k in names if k in ("rope_factor",) or not k.startswith(("rope_o", "beta", "mscale"))]
        fields = {k: getattr(args, k) for k in names}
        if args.n_dense_layers:
            fields["dense_hidden"] = args.dense_hidden
        fields["enable_weight_tying"] = args.enable_weight_tying
        return fields

    def architecture_config(self, args: Any, dtype: str) -> dict[str, Any]:
        """config.json for `args`, in the published DeepSeek-V3 spelling (rope_theta + rope_scaling)."""
        if args.score_func != "sigmoid":
            raise CheckpointError(
                "model args score_func = 'softmax', but DeepSeek-V3 routes on sigmoid scores; "
                "this model cannot be exported as DeepseekV3ForCausalLM"
            )
        cfg: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": args.dim,
            "intermediate_size": args.dense_hidden,
            "moe_intermediate_size": args.moe_inter_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_heads,
            "n_routed_experts": args.n_routed_experts,
            "n_shared_experts": args.n_shared_experts,
            "num_experts_per_tok": args.top_k,
            "first_k_dense_replace": args.n_dense_layers,
            "norm_topk_prob": args.route_norm,
            "routed_scaling_factor": args.route_scale,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": args.n_group,
            "topk_group": args.topk_group,
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "num_nextn_predict_layers": args.mtp_depth,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "rope_interleave": True,
            "max_position_embeddings": args.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": args.enable_weight_tying,
            "torch_dtype": dtype,
        }
        if args.rope_factor > 1:
            cfg["rope_scaling"] = {
                "type": "yarn",
                "factor": args.rope_factor,
                "original_max_position_embeddings": args.rope_original_seq_len,
                "beta_fast": args.beta_fast,
                "beta_slow": args.beta_slow,
                "mscale": args.mscale,
                "mscale_all_dim": args.mscale_all_dim,
            }
        return cfg

    def describe(self, key: str, value: Any) -> Any:
        """A config value as config.json spells it, for an error message."""
        return value


ADAPTER = DeepSeekV3HFAdapter()
