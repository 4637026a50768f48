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

import torch

from torchtitan_amp.models.gpt_oss.model import GptOssModelArgs

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
