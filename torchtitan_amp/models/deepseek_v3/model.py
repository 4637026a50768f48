"""DeepSeek-V3's model: args, flavors, blocks and FLOP count.

A block is Llama's pre-norm block (attention_norm, attention, ffn_norm, feed_forward) with
multi-head latent attention (mla.py) and, after the first `n_dense_layers` blocks
(first_k_dense_replace), the MoE family's layer (models/moe/moe.py) routing DeepSeek-V3's way:
sigmoid scores, the auxiliary-loss-free expert bias (e_score_correction_bias) moving the choice
only, group-limited choice (n_group, topk_group), top-k renormalised (norm_topk_prob) and scaled
by routed_scaling_factor, plus shared experts. Balancing, expert parallel and the load metrics
are the MoE family's (balance.py, expert_parallel).

Multi-token prediction (mtp_depth D > 0, DeepSeek-V3 report sec. 2.2): D sequential modules
(`mtp.{n_layers}` .. `mtp.{n_layers + D - 1}`, HF's layer numbers), depth k combining the previous
depth's hidden state at position i (the main model's before its final norm for k = 1) with the
embedding of token i + k, through one more block, into a prediction of token i + k + 1 by the
shared output head. Their cross-entropy, weighted
by mtp_loss_weight / D, is added to the training loss when the forward is given the labels; the
logits (the main path) never depend on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from torchtitan_amp.models.deepseek_v3.mla import MLAttention, yarn_tables
from torchtitan_amp.models.llama3.model import FeedForward, RMSNorm, Transformer, TransformerBlock
from torchtitan_amp.models.loss import IGNORE_INDEX, loss_fn
from torchtitan_amp.models.moe.model import LOAD_BALANCE, SCORE_FUNCS, MoEModelArgs, moe_layer


@dataclass
class DeepSeekV3Args(MoEModelArgs):
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    use_scaled_rope: bool = False  # Llama 3.1's scaling: never here (YaRN below instead)
    score_func: str = "sigmoid"
    route_norm: bool = True
    q_lora_rank: int = 0  # 0: queries projected directly (wq), as DeepSeek-V2-Lite
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_group: int = 1  # expert groups for group-limited routing (1: none)
    topk_group: int = 1  # groups a token may choose from
    # YaRN (rope_scaling type "yarn"); rope_factor 1 is plain rotary embedding.
    rope_factor: float = 1.0
    rope_original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Multi-token prediction: D extra modules (0: off) and the weight lambda of their mean loss.
    # 0.3 is the report's weight for its first 10T tokens (0.1 after).
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        # Not MoEModelArgs': MLA has no dim / n_heads head size and one latent for all heads.
        checks = (
            (self.n_kv_heads in (None, self.n_heads), f"n_kv_heads {self.n_kv_heads}: MLA has one key/value per head"),
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for rope"),
            (1 <= self.top_k <= self.n_routed_experts, f"top_k {self.top_k} not in [1, {self.n_routed_experts}]"),
            (self.score_func in SCORE_FUNCS, f"score_func {self.score_func!r} not one of {', '.join(SCORE_FUNCS)}"),
            (
                self.load_balance in LOAD_BALANCE,
                f"load_balance {self.load_balance!r} not one of {', '.join(LOAD_BALANCE)}",
            ),
            (
                self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
                f"n_group {self.n_group} must divide n_routed_experts {self.n_routed_experts}",
            ),
            (
                1 <= self.topk_group <= self.n_group,
                f"topk_group {self.topk_group} not in [1, n_group = {self.n_group}]",
            ),
            (
                self.top_k <= self.topk_group * self.n_routed_experts // self.n_group,
                f"top_k {self.top_k} exceeds the experts of topk_group {self.topk_group} groups",
            ),
            (not self.use_scaled_rope, "use_scaled_rope (Llama 3.1 scaling) does not apply; DeepSeek-V3 uses YaRN"),
            (self.mtp_depth >= 0, f"mtp_depth {self.mtp_depth} must be >= 0 (0: no multi-token prediction)"),
            (
                self.mtp_depth < self.max_seq_len,
                f"mtp_depth {self.mtp_depth} must be below the sequence length {self.max_seq_len} "
                f"(training.seq_len): depth k predicts the token k + 1 places ahead",
            ),
            (self.mtp_loss_weight >= 0, f"mtp_loss_weight {self.mtp_loss_weight} must be >= 0"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def head_dim(self) -> int:
        """A query's / key's head size (no-position part + rotated part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class DeepSeekV3Block(TransformerBlock):
    """Llama's block (its init_weights and forward) with MLA and a dense or routed MLP."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        nn.Module.__init__(self)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLAttention(args)  # type: ignore[assignment]  # Llama's slot, MLA's module
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: nn.Module
        if args.is_moe_layer(layer_id):
            self.feed_forward = moe_layer(args, n_groups=args.n_group, topk_groups=args.topk_group)
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5


class MultiTokenPrediction(nn.Module):
    """One depth of multi-token prediction: h' = eh_proj([enorm(embedding); hnorm(h)]), then one
    block (dense or MoE as the model's layer `layer_id`), then `norm` (HF's shared_head.norm) before
    the model's output head. The concatenation puts the embedding first, as the published
    checkpoints' eh_proj columns are laid out (vLLM and SGLang read them so)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.k = layer_id - args.n_layers + 1  # the depth (1-based): the TP plan reads it
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = DeepSeekV3Block(layer_id, args)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()

    def forward(
        self,
        h: torch.Tensor,
        embedded: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        labels: torch.Tensor,
        head: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the depth's hidden states [B, S', dim] before `norm`, the cross-entropy summed over
        `labels`): everything the depth computes, inside this forward, so that FSDP's hooks around
        it (one unit per depth, its fp32 norms a nested unit) have its parameters gathered. The
        shift happens here, on whole sequences: under TP with sequence parallel the plan gathers
        `h` and `embedded` at this forward's entry (deepseek_v3/parallelize.py).

        Args:
            h: the previous depth's hidden states [B, >= S', dim] (the last block's, S long, for
                depth 1); positions 0 .. S'-1 are read.
            embedded: the embeddings of the window's tokens [B, S, dim]; the last S' are read
                (the tokens k places later).
            rope: (cos, sin, mask): the rotary tables and None (causal) or the block-causal mask of
                the S' positions.
            labels: [B, S'] the targets (the tokens k + 1 places later; IGNORE_INDEX where none).
            head: the model's output projection (shared; the root's parameters, gathered during
                the root's forward).
        """
        cos, sin, mask = rope
        n = labels.shape[1]
        h, embedded = h[:, :n], embedded[:, embedded.shape[1] - n :]
        # In the residual stream's dtype (h's): under autocast eh_proj's output is bf16, and the
        # block's residual adds would otherwise run in bf16 where the layers' run in fp32.
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)).to(h.dtype)
        h = self.block(x, cos, sin, mask=mask)
        return h, loss_fn(head(self.norm(h)), labels, reduction="sum")


def mtp_labels(labels: torch.Tensor, doc_ids: torch.Tensor | None, k: int) -> torch.Tensor:
    """Depth k's targets [B, S - k]: position i predicts labels[i + k] (the token i + k + 1),
    IGNORE_INDEX where that token is in another document than token i (document masking: the
    depth's attention and its input h_i stay in token i's document). The token after the window
    (the last label's) is taken to be in the last token's document, as nothing says otherwise.

    Args:
        labels: [B, S] the main loss's targets.
        doc_ids: [B, S] each token's document, or None (causal: one stream, nothing ignored).
        k: the depth (1-based).
    """
    seq = labels.shape[1]
    if doc_ids is None:
        return labels[:, k:]
    target_docs = torch.cat([doc_ids[:, 1:], doc_ids[:, -1:]], dim=1)[:, k:]  # the doc of label j's token
    crossed = doc_ids[:, : seq - k] != target_docs
    return labels[:, k:].masked_fill(crossed, IGNORE_INDEX)


class DeepSeekV3Transformer(Transformer):
    block_cls = DeepSeekV3Block

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args)
        # mtp_depth > 0: the prediction modules, keyed as Hugging Face numbers them, after the
        # layers: depth k is mtp.{n_layers + k - 1} (model.layers.61 of the 671B).
        self.mtp: nn.ModuleDict | None = None
        if args.mtp_depth:
            ids = range(args.n_layers, args.n_layers + args.mtp_depth)
            self.mtp = nn.ModuleDict({str(i): MultiTokenPrediction(i, args) for i in ids})
        self.mtp_loss: torch.Tensor | None = None  # set by a forward given labels, taken by pop_mtp_loss

    @property
    def carries_embeddings(self) -> bool:
        """Whether this is a pipeline stage (an end missing) of a model with multi-token
        prediction: the embeddings travel beside the hidden states to the last stage's depths."""
        stage = self.tok_embeddings is None or self.output is None
        return stage and cast(DeepSeekV3Args, self.model_args).mtp_depth > 0

    def pop_extra_losses(self) -> dict[str, torch.Tensor]:
        """The losses the last labelled forward added, by the name the trainer logs them under
        (sums over the targets, weighted like the main loss's sum); the trainer asks after every
        labelled forward. A pipeline stage without the depths holds 0, as it does of the main loss."""
        if self.mtp is None and cast(DeepSeekV3Args, self.model_args).mtp_depth > 0:
            return {"mtp_loss": torch.zeros((), device=self.rope_cos.device)}
        loss = self.pop_mtp_loss()
        return {"mtp_loss": loss} if loss is not None else {}

    def pop_mtp_loss(self) -> torch.Tensor | None:
        """The last labelled forward's multi-token prediction loss (a sum over the targets, to be
        weighted like the main loss's sum), handed over once."""
        loss, self.mtp_loss = self.mtp_loss, None
        return loss

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)
        for module in (self.mtp or {}).values():
            cast(MultiTokenPrediction, module).init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Llama's forward (the logits, or hidden states on a pipeline stage without the head);
        with `labels` [B, S] and mtp_depth > 0, the multi-token prediction loss is computed from
        the last block's output and kept for pop_mtp_loss. Under pipeline parallel with
        mtp_depth > 0 the stages pass the embeddings along beside the hidden states,
        [h; embedded] on the last dim, to the last stage, which holds the depths (and the
        embeddings' gradient flows back to the first stage's table the same way).

        Args:
            tokens: the token ids [B, S] (or hidden states on a stage without the embedding;
                [h; embedded] when `carries_embeddings`).
            doc_ids: [B, S] each token's document (attention stays inside it); None: causal.
            positions: [B, S] the tokens' places in their window; None: 0..S-1.
            kv_doc_ids: [B, cp x S] the gathered keys' documents under context parallel, or None.
            labels: [B, S] the main loss's targets; given, the MTP loss is computed (mtp_depth > 0).
        """
        cos, sin, mask = self._attention_inputs(doc_ids, positions, kv_doc_ids)
        self.prepare_flex(mask, tokens.shape[1])
        if self.tok_embeddings is not None:
            h = embedded = self.tok_embeddings(tokens)
        else:
            h, embedded = tokens.chunk(2, dim=-1) if self.carries_embeddings else (tokens, tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask=mask)
        if self.output is None and self.carries_embeddings:
            return torch.cat([h, embedded], dim=-1)
        if labels is not None and self.mtp is not None:
            self.mtp_loss = self._mtp_loss(h, embedded, labels, doc_ids)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _mtp_loss(
        self, h: torch.Tensor, embedded: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """(mtp_loss_weight / D) x the sum over depths k of the cross-entropy summed over the valid
        targets: position i (0-based) combines h^{k-1}_i with the embedding of tokens[i + k] and
        predicts labels[i + k] (the token i + k + 1), for i < S - k; under document masking a
        target in another document than token i is ignored (mtp_labels). A sum, like the main
        loss's: the trainer divides both by the main loss's count of labels (the report's 1 / T)."""
        assert self.mtp is not None and self.output is not None
        seq, losses = labels.shape[1], []
        args = cast(DeepSeekV3Args, self.model_args)
        for k, mtp in enumerate(self.mtp.values(), start=1):
            docs = doc_ids[:, : seq - k] if doc_ids is not None else None
            rope = self._attention_inputs(docs, None)
            self.prepare_flex(rope[2], seq - k)  # the depth's S - k queries: built before its compiled block
            h, loss = mtp(h, embedded, rope, mtp_labels(labels, doc_ids, k), self.output)
            losses.append(loss)
        # Under TP's loss parallel each loss is a replicated DTensor, as the main loss is.
        return sum(losses[1:], losses[0]) * (args.mtp_loss_weight / len(self.mtp))

    def _precompute_rope(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        return yarn_tables(self.model_args, device)


_DEBUG = DeepSeekV3Args(
    dim=64,
    n_layers=4,
    n_heads=4,
    vocab_size=258,
    max_seq_len=2048,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    top_k=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_inter_dim=32,
    n_dense_layers=1,
    dense_inter_dim=128,
    route_scale=2.5,
)

_V3_671B = DeepSeekV3Args(
    dim=7168,
    n_layers=61,
    n_heads=128,
    vocab_size=129280,
    max_seq_len=163840,
    q_lora_rank=1536,
    kv_lora_rank=512,
    n_routed_experts=256,
    top_k=8,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    moe_inter_dim=2048,
    n_dense_layers=3,
    dense_inter_dim=18432,
    route_scale=2.5,
    rope_factor=40.0,
    rope_original_seq_len=4096,
    mscale=1.0,
    mscale_all_dim=1.0,
    mtp_depth=1,
)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # 0.29M parameters: 4 heads of MLA (latent ranks 32, 16 + 8 qk, 16 v), the first block dense,
    # 8 experts in 4 groups, top 3 from the best 2 groups, one shared expert, scale 2.5.
    "debugmodel": _DEBUG,
    # 16B class (DeepSeek-V2-Lite's shapes, torchtitan's deepseek_v3 "16B"): no query LoRA, latent
    # 512, 27 layers with the first dense, 64 experts top 6 plus 2 shared, V3's sigmoid routing.
    "deepseek_v3_16b": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        max_seq_len=4096,
        q_lora_rank=0,
        kv_lora_rank=512,
        n_routed_experts=64,
        top_k=6,
        n_shared_experts=2,
        moe_inter_dim=1408,
        n_dense_layers=1,
        dense_inter_dim=10944,
    ),
    # DeepSeek-V3 / R1 671B (its published config.json): 61 layers, the first 3 dense, 256 experts
    # in 8 groups, top 8 from 4 groups, one shared, scale 2.5; YaRN x40 over a 4096 context, and the
    # published multi-token prediction depth (num_nextn_predict_layers 1: every layout but CP).
    "deepseek_v3_671b": _V3_671B,
    # The 671B without its prediction depth (671.0B): for pre-training where MTP is not wanted, and
    # on context parallel (which the depth does not run on); docs/scaling.md plans both. An import
    # of the published folder needs the flavor above.
    "deepseek_v3_671b_no_mtp": dataclasses.replace(_V3_671B, mtp_depth=0),
    # debugmodel with one multi-token prediction depth (its block routed, as the 671B's is).
    "debugmodel_mtp": dataclasses.replace(_DEBUG, mtp_depth=1),
}


def takes_labels(args: DeepSeekV3Args) -> bool:
    """The family's takes_labels: the forward computes multi-token prediction's loss from the
    labels when the flavor has depths (pop_extra_losses hands it over)."""
    return args.mtp_depth > 0


def active_params(args: DeepSeekV3Args, total_excl_embedding: int) -> int:
    """Parameters a token's forward uses (embeddings excluded): top_k of the routed experts, in
    the layers and the multi-token prediction depths' blocks."""
    per_expert = 3 * args.dim * args.moe_inter_dim
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers + args.mtp_depth))
    return total_excl_embedding - moe_layers * (args.n_routed_experts - args.top_k) * per_expert


def flops_per_token(args: DeepSeekV3Args, num_params_excl_embedding: int, seq_len: int) -> int:
    """6N with N the active parameters, plus attention's two matmuls per layer and head (scores
    over the qk head size, values over v_head_dim), x 3 for forward and backward, 2 FLOPs each.
    A multi-token prediction depth counts as one more layer, plus the shared output head run again
    (its dim x vocab_size weight is in N once); its S - k positions are counted as S.

    Args:
        args: the model's arguments (layers, heads, head sizes, experts).
        num_params_excl_embedding: the parameters without the embedding table (N).
        seq_len: the training sequence length (the attention term grows with it).
    """
    layers = args.n_layers + args.mtp_depth
    attention = 6 * layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
    head_again = args.mtp_depth * args.dim * args.vocab_size
    return 6 * (active_params(args, num_params_excl_embedding) + head_again) + attention
