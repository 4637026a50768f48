"""flex vs SDPA on the llama3 debug model with packed documents (block_causal): the loss and every
gradient of one fp32 forward + backward, then each backend's step time and peak memory. On CUDA at
seq 8192; on CPU (the GPU_CHECKS_DEVICE=cpu trial) the forward only, no grad (torch has no
FlexAttention backward on CPU). Runs with GPU_CHECKS_SPEED=1 (outside the default budget):
`GPU_CHECKS_SPEED=1 GPU_RUN_MFU=0 bash scripts/gpu_run.sh -k flex`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Transformer

pytestmark = pytest.mark.gpu

# fp32 on both: the two kernels sum in other orders; the loss (a mean over 8192 tokens) to 1e-5
# relative, each gradient to 1e-3 of its norm (the backward's sums over S keys carry S u ~ 5e-4).
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-3


def _batch(seq: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, seq), generator=gen)
    # Documents of 64..2048 tokens packed into the window.
    cuts = torch.randint(64, 2048, (seq // 64,), generator=gen).cumsum(0)
    docs = torch.bucketize(torch.arange(seq), cuts[cuts < seq], right=True).to(torch.int32)[None]
    return tokens.to(device), docs.to(device)


def _run(model: Transformer, backend: str, tokens: torch.Tensor, docs: torch.Tensor, train: bool) -> dict[str, Any]:
    model.attention_backend = backend
    model.zero_grad(set_to_none=True)
    if tokens.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        logits = model(tokens, doc_ids=docs)
        loss = F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
        if train:
            loss.backward()
    if tokens.is_cuda:
        torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    peak = torch.cuda.max_memory_allocated() if tokens.is_cuda else 0
    return {"loss": loss.item(), "grads": grads, "seconds": time.perf_counter() - start, "peak_bytes": peak}


def test_flex(a: Any, out: dict[str, Any]) -> None:
    cuda = a.device == "cuda"
    seq = 8192 if cuda else 256
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=seq)).to(a.device)
    model.init_weights()
    tokens, docs = _batch(seq, a.device)
    runs: dict[str, dict[str, Any]] = {}
    for backend in ("sdpa", "flex", "sdpa", "flex"):  # the second of each timed (compiled, warm)
        runs[backend] = _run(model, backend, tokens, docs, train=cuda)
    sdpa, flex = runs["sdpa"], runs["flex"]
    out.update(
        seq=seq,
        loss={"sdpa": sdpa["loss"], "flex": flex["loss"]},
        step_seconds={"sdpa": sdpa["seconds"], "flex": flex["seconds"]},
        peak_bytes={"sdpa": sdpa["peak_bytes"], "flex": flex["peak_bytes"]},
    )
    assert abs(flex["loss"] - sdpa["loss"]) <= LOSS_RTOL * abs(sdpa["loss"])
    worst = (
        max(((flex["grads"][n] - g).norm() / g.norm().clamp(min=1e-30)).item() for n, g in sdpa["grads"].items())
        if sdpa["grads"]
        else 0.0
    )
    out["worst_grad_rel_diff"] = worst
    assert worst <= GRAD_RTOL
