"""DeepSeek-V3's terms in the memory model: the MoE family's (memory/moe.py) with MLA's
parameters in place of grouped-query attention's. Parameters are exact (tests/test_deepseek_v3.py
compares the count with the model's); activations are the MoE family's with H heads of the qk head
size for queries, keys and values (MLA's values are narrower, v_head_dim, and its latents add
(q_lora_rank + kv_lora_rank + qk_rope_head_dim) per token: both left out of the estimate).
Multi-token prediction's modules (mtp_depth) are parameters of the last stage, exact too (each
depth's block is the model's layer n_layers + k - 1, routed or dense as that layer would be); their
activations are left out of the estimate (one more block's per depth).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan_amp.memory.moe import MoEDims
from torchtitan_amp.memory.specs import ParamSpec, Stage

_GQA = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight")


@dataclass(frozen=True)
class MLADims(MoEDims):
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mtp_depth: int = 0

    @classmethod
    def from_args(cls, args: Any) -> MLADims:
        """From DeepSeekV3Args: the MoE family's fields, the qk head size as the head size."""
        base = MoEDims.from_args(args)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(MoEDims)}
        fields["explicit_head_dim"] = args.qk_nope_head_dim + args.qk_rope_head_dim
        return cls(
            **fields,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            mtp_depth=args.mtp_depth,
        )

    def moe_layers(self) -> int:
        """The routed blocks, the multi-token prediction modules' included (active_params drops
        their unused experts as the layers')."""
        return sum(self.is_moe(i) for i in range(self.n_layers + self.mtp_depth))

    def param_specs(self, stage: Stage) -> list[ParamSpec]:
        """The decoder's (`_decoder_specs`) and, on the last stage, each multi-token prediction
        module's: its block as layer n_layers + k - 1 is, renamed under `mtp.{that}.block.`, with its
        two input norms, its 2 dim -> dim projection and its output norm (all replicated)."""
        out = self._decoder_specs(stage)
        if not (stage.last and self.mtp_depth):
            return out
        d, ids = self.dim, range(self.n_layers, self.n_layers + self.mtp_depth)
        blocks = self._decoder_specs(Stage(stage.index, ids, False, False))
        for i in ids:
            p = f"mtp.{i}."
            out += [ParamSpec(p + n, (d,), "norm", None, i) for n in ("enorm.weight", "hnorm.weight")]
            out.append(ParamSpec(p + "eh_proj.weight", (d, 2 * d), "linear", None, i))
            block = [s for s in blocks if s.block == i]
            out += [dataclasses.replace(s, name=s.name.replace(f"layers.{i}.", p + "block.", 1)) for s in block]
            out.append(ParamSpec(p + "norm.weight", (d,), "norm", None, i))
        return out

    def _decoder_specs(self, stage: Stage) -> list[ParamSpec]:
        """The MoE family's, MLA's projections and latent norms in place of wq / wk / wv / wo
        (wq_b, wkv_b split by head and wo by its input under TP's usual rule; the latent
        projections and norms replicated)."""
        d, h, qk = self.dim, self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        out: list[ParamSpec] = []
        for spec in super().param_specs(stage):
            if not spec.name.endswith(_GQA):
                out.append(spec)
                continue
            if not spec.name.endswith("attention.wo.weight"):
                continue
            p, i = spec.name.removesuffix("wo.weight"), spec.block
            if self.q_lora_rank:
                r = self.q_lora_rank
                out += [
                    ParamSpec(p + "wq_a.weight", (r, d), "linear", None, i),
                    ParamSpec(p + "q_norm.weight", (r,), "norm", None, i),
                    ParamSpec(p + "wq_b.weight", (h * qk, r), "linear", 0, i),
                ]
            else:
                out.append(ParamSpec(p + "wq.weight", (h * qk, d), "linear", 0, i))
            kv = self.kv_lora_rank
            out += [
                ParamSpec(p + "wkv_a.weight", (kv + self.qk_rope_head_dim, d), "linear", None, i),
                ParamSpec(p + "kv_norm.weight", (kv,), "norm", None, i),
                ParamSpec(p + "wkv_b.weight", (h * (self.qk_nope_head_dim + self.v_head_dim), kv), "linear", 0, i),
                ParamSpec(p + "wo.weight", (d, h * self.v_head_dim), "linear", 1, i),
            ]
        return out
