"""Worker behind tests/test_flex_attention.py's context-parallel test: one model's no-grad forward
on cp 2 with flex and with SDPA, and on one process.

    tests/support/launch.py: run_distributed(cp_flex.forward_under_cp, 2, cases)

`cases`: {name: {"family": "llama3" | "gpt_oss", "documents": bool}}. Each rank builds the same
debug model (seed 0, vocabulary 64, 64 tokens, batch 2) and first runs the whole window on its
own (SDPA: the one-process reference); then context parallel over the world group
(context_parallel.apply_cp, BatchSharder's head-tail chunks, positions and keys' documents) with
model.attention_backend "sdpa" and then "flex". Each rank's logits are all-gathered and put back in
window order. Rank 0 returns, per case, the max |difference| of flex-on-CP and SDPA-on-CP from the
reference and from each other, the logits' max magnitude, and how many times each CP forward
called FlexAttention (attention._flex, wrapped), beside the model's layer count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_amp.distributed.context_parallel import BatchSharder, ContextParallel, apply_cp, gathered_positions
from torchtitan_amp.models import attention
from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS, GptOssTransformer
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Transformer


def _docs(batch: int, seq: int) -> torch.Tensor:
    """Documents that start mid-chunk on both ranks' chunks (cp 2: chunks of seq / 4)."""
    ids = torch.zeros(batch, seq, dtype=torch.int32)
    ids[0, seq // 4 + 3 :] += 1
    ids[0, seq // 2 + 5 :] += 1
    ids[1, 5:] += 1
    ids[1, 40:] += 1
    return ids


def _model(family: str) -> Any:
    torch.manual_seed(0)
    if family == "gpt_oss":
        model: Any = GptOssTransformer(
            dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64, vocab_size=64)
        )
    else:
        model = Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64, vocab_size=64))
    model.init_weights()
    return model.eval()


def _case(family: str, documents: bool, cp: ContextParallel) -> dict[str, float]:
    model = _model(family)
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    docs = _docs(2, 64) if documents else None
    with torch.no_grad():
        ref = model(tokens, doc_ids=docs)
    apply_cp(model, cp)
    sharder = BatchSharder(lambda t: {"doc_ids": docs} if docs is not None else {}, cp.degree, cp.rank)
    inputs, _, extra = sharder(tokens, tokens)
    order = gathered_positions(64, cp.degree).argsort()
    outs, calls = {}, []
    flex = attention._flex

    def counted(compiled: bool) -> Any:
        calls.append(model.attention_backend)
        return flex(compiled)

    for backend in ("sdpa", "flex"):
        model.attention_backend = backend
        attention._flex = counted
        try:
            with torch.no_grad():
                local = model(inputs, **extra)
        finally:
            attention._flex = flex
        parts = [torch.empty_like(local) for _ in range(cp.degree)]
        dist.all_gather(parts, local.contiguous(), group=cp.group)
        outs[backend] = torch.cat(parts, dim=1).index_select(1, order)
    return {
        "flex_vs_one": (outs["flex"] - ref).abs().max().item(),
        "sdpa_vs_one": (outs["sdpa"] - ref).abs().max().item(),
        "flex_vs_sdpa": (outs["flex"] - outs["sdpa"]).abs().max().item(),
        "logit_max": ref.abs().max().item(),
        "flex_calls": calls.count("flex"),
        "sdpa_flex_calls": calls.count("sdpa"),
        "layers": len(model.layers),
    }


def forward_under_cp(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Every case on cp = the world (2 ranks); rank 0 returns the differences."""
    cp = ContextParallel(dist.group.WORLD)  # type: ignore[arg-type]
    results = {name: _case(case["family"], case["documents"], cp) for name, case in cases.items()}
    return results if dist.get_rank() == 0 else None
