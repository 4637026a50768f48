"""gpt-oss's transformers reference for the family's tests: GptOssConfig of our args, and a random
GptOssForCausalLM sharpened so that routing, the sinks, the clamp and every bias matter."""

from __future__ import annotations

import torch

from torchtitan_amp.models.gpt_oss.model import GptOssModelArgs


def hf_config(args: GptOssModelArgs):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.moe_inter_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_local_experts=args.n_routed_experts,
        num_experts_per_tok=args.top_k,
        sliding_window=args.sliding_window,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": args.yarn_factor,
            "beta_fast": args.yarn_beta_fast,
            "beta_slow": args.yarn_beta_slow,
            "truncate": args.yarn_truncate,
            "original_max_position_embeddings": args.yarn_original_max_position,
        },
        attn_implementation="eager",
    )


def sharpened_hf(args: GptOssModelArgs):
    """A random transformers model whose weights are scaled so that routing margins, the sinks, the
    clamp (limit 7) and every bias take part."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(hf_config(args)).eval()
    std = {"router.weight": 1.0, "sinks": 2.0, "gate_up_proj": 0.6, "down_proj": 0.2, "bias": 0.3}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "embed" not in name and "lm_head" not in name:
                s = next((v for k, v in std.items() if k in name), 0.1)
                p.copy_(s * torch.randn_like(p))
    return model
