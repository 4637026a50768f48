"""The gpt-oss family's Hugging Face names: transformers' GptOssForCausalLM layout and ours, in
both directions, as whole state dicts (`from_hf_state_dict`, `to_hf_state_dict`).

What differs from Llama's names: q / k weights and biases rotate halves there, interleaved pairs
here (permuted within each head); the sinks are `self_attn.sinks`; the router is `mlp.router`
with a bias; the experts are stacked [E, ...] tensors in x @ W orientation like ours, but gate
and up are one `gate_up_proj` [E, dim, 2 x hidden] with gate in the even columns and up in the
odd ones (ours: w1 and w3), and their biases likewise (`gate_up_proj_bias`). Our expert_bias
(bias balancing) has no counterpart: zero on import. The released checkpoints store the experts'
weights in MXFP4 (`*_blocks` / `*_scales`): checkpoint/mxfp4.py dequantizes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.gpt_oss.model import GptOssModelArgs
from torchtitan_amp.models.llama3.hf import rope_settings
from torchtitan_amp.models.spec import Derived, HFAdapter

CONFIG = "config.json"

# Our FQN inside layers.<i>. -> HF's inside model.layers.<i>. (one to one)
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
    "attention.core.sinks": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
TOP_NAMES["output.weight"] = "lm_head.weight"
# Ours taken from HF's interleaved gate_up tensors: (HF name, column parity)
INTERLEAVED = {
    "feed_forward.experts.w1": ("mlp.experts.gate_up_proj", 0),
    "feed_forward.experts.w3": ("mlp.experts.gate_up_proj", 1),
    "feed_forward.experts.b1": ("mlp.experts.gate_up_proj_bias", 0),
    "feed_forward.experts.b3": ("mlp.experts.gate_up_proj_bias", 1),
}
ROTARY = re.compile(r"^layers\.\d+\.attention\.w[qk]\.(weight|bias)$")
EXPERT_BIAS = re.compile(r"\.feed_forward\.router\.expert_bias$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Halves -> interleaved pairs, rows of each head (checkpoint/hf.py's, for a weight or a bias)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotary_heads(fqn: str, args: GptOssModelArgs) -> int | None:
    """The head count of a q / k weight or bias (whose rows the two rotary layouts order
    differently), None for every other tensor."""
    if not ROTARY.search(fqn):
        return None
    return args.n_heads if ".wq." in fqn else args.kv_heads


def hf_name(fqn: str) -> str:
    """Our FQN -> its HF name (for the interleaved parts: the HF tensor they are taken from)."""
    if fqn in TOP_NAMES:
        return TOP_NAMES[fqn]
    m = _LAYER.match(fqn)
    if m is None or (m[2] not in LAYER_NAMES and m[2] not in INTERLEAVED):
        raise KeyError(fqn)
    inner = LAYER_NAMES.get(m[2]) or INTERLEAVED[m[2]][0]
    return f"model.layers.{m[1]}.{inner}"


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: GptOssModelArgs) -> dict[str, torch.Tensor]:
    """An HF state dict (dequantized) -> ours (expert_bias zero)."""
    out: dict[str, torch.Tensor] = {}
    for layer in range(args.n_layers):
        out[f"layers.{layer}.feed_forward.router.expert_bias"] = torch.zeros(args.n_routed_experts)
        for inner, (name, parity) in INTERLEAVED.items():
            out[f"layers.{layer}.{inner}"] = hf[f"model.layers.{layer}.{name}"][..., parity::2].contiguous()
        for inner in LAYER_NAMES:
            fqn = f"layers.{layer}.{inner}"
            value = hf[hf_name(fqn)]
            heads = rotary_heads(fqn, args)
            out[fqn] = permute_from_hf(value, heads) if heads else value
    for fqn, name in TOP_NAMES.items():
        out[fqn] = hf[name]
    return out


def to_hf_state_dict(ours: dict[str, torch.Tensor], args: GptOssModelArgs) -> dict[str, torch.Tensor]:
    """Ours -> an HF state dict (the inverse of from_hf_state_dict; a nonzero expert_bias refused)."""
    out: dict[str, torch.Tensor] = {}
    for fqn, value in ours.items():
        if EXPERT_BIAS.search(fqn):
            if value.count_nonzero():
                raise ValueError(f"'{fqn}' is nonzero, and a gpt-oss model has no place for it")
            continue
        m = _LAYER.match(fqn)
        if m is not None and m[2] in INTERLEAVED:
            continue
        heads = rotary_heads(fqn, args)
        out[hf_name(fqn)] = permute_to_hf(value, heads) if heads else value
    for layer in range(args.n_layers):
        for gate, up in (("w1", "w3"), ("b1", "b3")):
            g, u = (ours[f"layers.{layer}.feed_forward.experts.{n}"] for n in (gate, up))
            name = hf_name(f"layers.{layer}.feed_forward.experts.{gate}")
            out[name] = torch.stack([g, u], dim=-1).flatten(-2)
    return out


_OUR_INTERLEAVED = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w1|w3|b1|b3)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FROM_HF_LAYER = {hf: ours for ours, hf in LAYER_NAMES.items()}
_FROM_HF_TOP = {hf: ours for ours, hf in TOP_NAMES.items()}

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
    "n_routed_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "moe_inter_dim": "intermediate_size",
    "sliding_window": "sliding_window",
    "swiglu_alpha": "swiglu_alpha",
    "swiglu_limit": "swiglu_limit",
    "yarn_factor": "rope_scaling.factor",
    "yarn_beta_fast": "rope_scaling.beta_fast",
    "yarn_beta_slow": "rope_scaling.beta_slow",
    "yarn_original_max_position": "rope_scaling.original_max_position_embeddings",
    "yarn_truncate": "rope_scaling.truncate",
    "enable_weight_tying": "tie_word_embeddings",
}


def _interleaved(name: str, parity: int) -> Derived:
    return Derived((name,), lambda d: d[name][..., parity::2], by_row=True)


def _whole(name: str) -> Derived:
    return Derived((name,), lambda d: d[name], by_row=True)


def _interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    """gate, up -> one tensor with gate in the even columns and up in the odd ones."""
    return torch.stack(parts, dim=-1).flatten(-2)


def _layer_types(n_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def _check_supported(cfg: dict[str, Any], where: Path, n_layers: int) -> None:
    if cfg.get("model_type") != "gpt_oss":
        raise CheckpointError(f"{where}: 'model_type' = {cfg.get('model_type')!r}; only 'gpt_oss' can be loaded")
    types = cfg.get("layer_types") or _layer_types(n_layers)
    if list(types) != _layer_types(n_layers):
        raise CheckpointError(
            f"{where}: 'layer_types' = {types}; only sliding and full layers alternating, the first sliding, "
            "are supported"
        )
    if not cfg.get("attention_bias", True):
        raise CheckpointError(f"{where}: 'attention_bias' = false; gpt-oss attention has biases")
    quant = (cfg.get("quantization_config") or {}).get("quant_method", "mxfp4")
    if quant != "mxfp4":
        raise CheckpointError(f"{where}: quantization {quant!r} is not supported (allowed: mxfp4, or none)")


class GptOssHFAdapter(HFAdapter[GptOssModelArgs]):
    """GptOssForCausalLM: the names above, gate_up split into w1 / w3 (and their biases) on import and
    interleaved back on export, MXFP4 experts decoded on import (checkpoint/hf_sources.py), and
    gpt-oss's config.json."""

    display_name = "gpt-oss"
    field_names = _HF_FIELD
    zero_in_hf = EXPERT_BIAS

    def to_hf_name(self, fqn: str) -> str:
        return hf_name(fqn)

    def from_hf_name(self, name: str) -> str | None:
        if name in _FROM_HF_TOP:
            return _FROM_HF_TOP[name]
        m = _HF_LAYER.match(name)
        inner = _FROM_HF_LAYER.get(m[2]) if m else None
        return f"layers.{m[1]}.{inner}" if m and inner else None

    def rotary_heads(self, fqn: str, args: GptOssModelArgs) -> int | None:
        return rotary_heads(fqn, args)

    def derived(self, args: GptOssModelArgs) -> dict[str, Derived]:
        """w1 / w3 (b1 / b3): the even / odd columns of each layer's gate_up_proj (its bias); w2: the
        down_proj as it is (derived too, so that its MXFP4 form is read)."""
        out = {
            f"layers.{i}.{ours}": _interleaved(f"model.layers.{i}.{name}", parity)
            for i in range(args.n_layers)
            for ours, (name, parity) in INTERLEAVED.items()
        }
        for i in range(args.n_layers):
            down = f"model.layers.{i}.mlp.experts.down_proj"
            out[f"layers.{i}.feed_forward.experts.w2"] = _whole(down)
        return out

    def merged(
        self, fqn: str, args: GptOssModelArgs
    ) -> tuple[str, list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None:
        """gate_up_proj from w1 and w3, gate_up_proj_bias from b1 and b3."""
        if not (m := _OUR_INTERLEAVED.match(fqn)):
            return None
        gate, up = ("w1", "w3") if m[2] in ("w1", "w3") else ("b1", "b3")
        group = [f"layers.{m[1]}.feed_forward.experts.{n}" for n in (gate, up)]
        return hf_name(group[0]), group, _interleave

    def config_fields(self, cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
        """The config.json fields this model reads, in model-args terms; CheckpointError for a config
        it cannot represent (another architecture, other layer types, no attention biases, a rope
        other than YaRN, a quantization other than MXFP4)."""
        where = folder / CONFIG

        def need(field: str) -> Any:
            if cfg.get(field) is None:
                raise CheckpointError(f"{where} has no '{field}'")
            return cfg[field]

        n_layers = int(need("num_hidden_layers"))
        _check_supported(cfg, where, n_layers)
        theta, scaling = rope_settings(cfg)
        if scaling is None or scaling["rope_type"] != "yarn":
            kind = "default" if scaling is None else scaling["rope_type"]
            raise CheckpointError(f"{where}: rope type {kind!r} is not supported for gpt-oss (allowed: yarn)")
        dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        return {
            "dim": dim,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "kv_heads": int(cfg.get("num_key_value_heads") or n_heads),
            "head_dim": int(cfg.get("head_dim") or dim // n_heads),
            "vocab_size": int(need("vocab_size")),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-5)),
            "rope_theta": theta,
            "n_routed_experts": int(need("num_local_experts")),
            "top_k": int(cfg.get("num_experts_per_tok") or need("experts_per_token")),
            "moe_inter_dim": int(need("intermediate_size")),
            "sliding_window": int(need("sliding_window")),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "yarn_factor": float(scaling["factor"]),
            "yarn_beta_fast": float(scaling.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(scaling.get("beta_slow") or 1.0),
            "yarn_original_max_position": int(scaling["original_max_position_embeddings"]),
            "yarn_truncate": bool(scaling.get("truncate", True)),
            "enable_weight_tying": bool(cfg.get("tie_word_embeddings", False)),
        }

    def args_fields(self, args: GptOssModelArgs) -> dict[str, Any]:
        return {key: getattr(args, key) for key in _HF_FIELD}

    def architecture_config(self, args: GptOssModelArgs, dtype: str) -> dict[str, Any]:
        """config.json for `args` in the published gpt-oss spelling (rope_theta + rope_scaling)."""
        if args.route_scale != 1.0 or args.score_func != "softmax" or not args.route_norm or args.n_shared_experts:
            raise CheckpointError(
                "gpt-oss routes on the softmax of the top-k logits, unscaled, without shared experts; "
                "these model args cannot be exported as GptOssForCausalLM"
            )
        cfg: dict[str, Any] = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": args.dim,
            "intermediate_size": args.moe_inter_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "num_local_experts": args.n_routed_experts,
            "num_experts_per_tok": args.top_k,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "sliding_window": args.sliding_window,
            "layer_types": _layer_types(args.n_layers),
            "swiglu_alpha": args.swiglu_alpha,
            "swiglu_limit": args.swiglu_limit,
            "rope_theta": args.rope_theta,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": args.yarn_factor,
                "beta_fast": args.yarn_beta_fast,
                "beta_slow": args.yarn_beta_slow,
                "original_max_position_embeddings": args.yarn_original_max_position,
                "truncate": args.yarn_truncate,
            },
            "max_position_embeddings": args.max_seq_len,
            "attention_bias": True,
            "hidden_act": "silu",
            "tie_word_embeddings": args.enable_weight_tying,
            "torch_dtype": dtype,
        }
        return cfg


ADAPTER = GptOssHFAdapter()
