"""Runs several training or evaluation jobs in one process (one torchrun launch) for
tests/test_checkpoint.py and tests/test_validation.py.

Usage: [torchrun ...] ckpt_jobs.py SPEC.json, where SPEC is tests/support/launch.py's spec with
  "options": {"step_delay": seconds slept after every train step (to give a signal time to arrive),
              "flavor": {field: value} replaces these LlamaModelArgs fields of the 'debugmodel'
                        flavor for every job (tests/test_hf.py's tiny GQA + rope-scaling model),
              "crash_in_save_step": N (die with os._exit(1) after every rank wrote step-N.tmp,
                                       before the completion marker: a save interrupted half way)},
  "jobs": [{"name": NAME, "args": [CLI overrides],
             "copy": [[src_dir, dst_dir], ...]   rank 0 copies before the job starts,
             "perturb_rng": true                 reseed python/torch RNGs per rank after loading,
             "rng_out": "file"                   write every rank's RNG draws after the job,
             "record_batches": "file"            write every rank's [dp rank, training rows] (a digest
                                                 of each input row, in the order the loader yielded them)
             "probe": "file",                    instead of training: loss on a fixed batch, one
                                                 train step on it, loss again, state checksum
             "evaluate": "file"                  instead of training: tools.evaluate on args
                                                 (a checkpoint's val_loss on this layout), to file
             "generate": "file"                  instead of training: tools.generate's records for
                                                 args (its command line; N ranks = TP N), to file
             "audit": "file"                     instead of training: Trainer.audit(), to file
             "logits": "file", "tokens": [[...]] instead of training: the full fp32 logits of
                                                 `tokens` on this layout, torch.save'd to file
             "attention_backend": "flex"         with "logits": the forward on that backend (set on
                                                 the built model: the config would refuse flex for
                                                 training on CPU, which has no flex backward)
             "lora_grads": "file", "tokens": [[...]] after training: LoRA's adapters (full tensors), the
                                                 loss of `tokens` (next-token cross-entropy) and the
                                                 adapters' gradients of it and their DTensor
                                                 placements, torch.save'd to file
             "full_init_max_params": N           for this job, models above N parameters take the
                                                 large-model path (build on meta, shard, then
                                                 materialise: train/job.py FULL_INIT_MAX_PARAMS)
             "hf_reads": "file"                  with "logits": every rank's count of tensor
                                                 elements read from a Hugging Face folder (JSON)
             "break": "fsdp_reduce_in_fp32"      for this job, FSDP reduces every gradient in fp32
                                                 whatever the plan says (the audit must catch it);
                      "cp_reduce_in_bf16"        context parallel sums K/V gradients in bf16
           }, ...]
Every job builds a fresh Trainer (the process group is shared); preemption handlers are
installed as train.py does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from tests.support.launch import digest, exit_process, probe_trainer, read_spec
from torchtitan_amp.checkpoint import preemption
from torchtitan_amp.checkpoint.saving import Saver
from torchtitan_amp.config import load_config
from torchtitan_amp.models.loss import IGNORE_INDEX
from torchtitan_amp.precision import PrecisionPlan, fsdp
from torchtitan_amp.tools.evaluate import evaluate
from torchtitan_amp.tools.generate import generate_texts, parse_args
from torchtitan_amp.train import build as train_build
from torchtitan_amp.train.trainer import Trainer


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj: object) -> list[object]:
    if not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


_HF_READS = [0]  # tensor elements this rank read through checkpoint/hf.py's reader


def _count_hf_reads() -> None:
    from torchtitan_amp.checkpoint.hf import HFReader

    original = HFReader._process_read_request

    def counting(self, f, req, planner):  # type: ignore[no-untyped-def]
        _HF_READS[0] += int(torch.Size(req.lengths).numel())
        return original(self, f, req, planner)

    HFReader._process_read_request = counting


def _install_test_hooks(options: dict) -> None:
    # MFU's CPU peak is measured with a 1024^3 matmul per dtype, which takes tens of seconds in
    # fp16 on a CPU without fp16 GEMM; these tests never read MFU.
    train_build.peak_flops = lambda device, dtype: 1e12
    delay = options.get("step_delay", 0)
    if delay:
        original_step = Trainer.train_step

        def slow_step(self, batches):  # type: ignore[no-untyped-def]
            out = original_step(self, batches)
            time.sleep(delay)
            return out

        Trainer.train_step = slow_step
    crash_step = options.get("crash_in_save_step")
    if crash_step is not None:
        original_commit = Saver.commit

        def crashing_commit(self, state, *args, **kwargs):  # type: ignore[no-untyped-def]
            if state.step == crash_step:
                _barrier()  # every rank has written its files into step-N.tmp
                os._exit(1)
            return original_commit(self, state, *args, **kwargs)

        Saver.commit = crashing_commit


@contextlib.contextmanager
def _broken(what: str | None):  # type: ignore[no-untyped-def]
    """A deliberate breach of the precision contract, for the audit's tests ("a+b": both)."""
    if what is None:
        yield
        return
    if "+" in what:
        with contextlib.ExitStack() as stack:
            for part in what.split("+"):
                stack.enter_context(_broken(part))
            yield
        return
    if what == "ep_dispatch_in_fp32":
        with _ep_dispatch_in_fp32():
            yield
        return
    if what == "cp_reduce_in_bf16":
        with _cp_reduce_in_bf16():
            yield
        return
    if what == "router_in_bf16":
        with _routers_in_bf16():
            yield
        return
    assert what == "fsdp_reduce_in_fp32", what
    original = fsdp.fsdp_policy

    def fp32_reduce(plan, **kwargs):  # type: ignore[no-untyped-def]
        policy = original(plan, **kwargs)
        return dataclasses.replace(policy, reduce_dtype=torch.float32)

    fsdp.fsdp_policy = fp32_reduce
    try:
        yield
    finally:
        fsdp.fsdp_policy = original


@contextlib.contextmanager
def _routers_in_bf16():  # type: ignore[no-untyped-def]
    """MoE routers told to route in bf16 while the plan says fp32 (router_dtype)."""
    original = PrecisionPlan.apply_router_dtype

    def bf16(self, model):  # type: ignore[no-untyped-def]
        names = original(self, model)
        for module in model.modules():
            if self.routes(module):
                module.router_dtype = torch.bfloat16
        return names

    PrecisionPlan.apply_router_dtype = bf16
    try:
        yield
    finally:
        PrecisionPlan.apply_router_dtype = original


@contextlib.contextmanager
def _ep_dispatch_in_fp32():  # type: ignore[no-untyped-def]
    """Expert parallel's token rows sent in fp32 (and cast back on arrival): the experts still
    compute in bf16, only the wire carries twice the bytes the plan names."""
    from torchtitan_amp.distributed import expert_parallel

    original = expert_parallel.all_to_all_single_autograd

    def fp32_exchange(rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        return original(rows.float(), *args, **kwargs).to(rows.dtype)

    expert_parallel.all_to_all_single_autograd = fp32_exchange
    try:
        yield
    finally:
        expert_parallel.all_to_all_single_autograd = original


@contextlib.contextmanager
def _cp_reduce_in_bf16():  # type: ignore[no-untyped-def]
    original = PrecisionPlan.context_parallel

    def bf16_sum(self, group):  # type: ignore[no-untyped-def]
        return dataclasses.replace(original(self, group), reduce_dtype=torch.bfloat16)

    PrecisionPlan.context_parallel = bf16_sum
    try:
        yield
    finally:
        PrecisionPlan.context_parallel = original


@torch.no_grad()
def _logits(trainer: Trainer, tokens: torch.Tensor) -> torch.Tensor | None:
    """The whole model's logits on every rank that has them (None elsewhere): a plain forward
    without PP (TP's vocab-sharded logits gathered), stage by stage over point-to-point sends
    with PP (each rank holds one stage)."""
    from torch.distributed.tensor import DTensor

    from torchtitan_amp.distributed.tensor_parallel import parallel_context

    tokens = tokens.to(trainer.run.device)
    for part in trainer.run.model_parts:
        part.eval()
    with parallel_context(trainer.run.dims, trainer.config):
        if not trainer.run.dims.pp_enabled:
            out = trainer.run.model(tokens)
            return out.full_tensor() if isinstance(out, DTensor) else out
        rank, world = _rank(), dist.get_world_size()
        assert len(trainer.run.model_parts) == 1 and trainer.run.dims.pp == world, "one stage per rank"
        h = tokens
        if rank > 0:
            h = torch.empty(*tokens.shape, trainer.run.job.model_args.dim)
            dist.recv(h, rank - 1)
        h = trainer.run.model(h)
        if rank < world - 1:
            dist.send(h.contiguous(), rank + 1)
            return None
        return h


def _lora_grads(trainer: Trainer, tokens: torch.Tensor) -> dict | None:
    """After training: the adapters, the loss of `tokens` and its adapter gradients (every rank
    computes the same tokens, so FSDP's mean of the gradients is the one-process gradient; under
    context parallel each rank its chunks of them, through Trainer.forward_backward, whose losses'
    mean over the ranks is the loss)."""
    from torch.distributed.tensor import DTensor

    from torchtitan_amp.precision import lora

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()

    adapters = {n: p for part in trainer.run.model_parts for n, p in lora.adapter_parameters(part).items()}
    for p in adapters.values():
        p.grad = None
    dims = trainer.run.dims
    if dims.cp_enabled or dims.pp_enabled:  # each rank its chunks or its stage: the trainer's own step
        labels = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)
        share = trainer.forward_backward(tokens.to(trainer.run.device), labels.to(trainer.run.device))
        shares = torch.stack([cast(torch.Tensor, s).cpu() for s in _gather(share)])
        loss = shares.sum() if dims.pp_enabled else shares.mean()  # PP: the last stage's loss, 0 elsewhere
    else:
        logits = trainer.run.model(tokens.to(trainer.run.device))
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    values = {n: full(p) for n, p in adapters.items()}
    grads = {n: full(p.grad) for n, p in adapters.items()}
    if dims.pp_enabled:  # each stage its blocks' adapters: all of them, from every rank
        values = {n: v for part in _gather(values) for n, v in cast(dict, part).items()}
        grads = {n: g for part in _gather(grads) for n, g in cast(dict, part).items()}
    placements = {n: str(p.placements) for n, p in adapters.items() if isinstance(p, DTensor)}
    result = {
        "loss": float(loss),
        "values": values,
        "grads": grads,
        "placements": placements,
        "nf4": _nf4_base(trainer),
    }
    return result if _rank() == 0 else None


def _nf4_base(trainer: Trainer) -> dict[str, torch.Tensor]:
    """QLoRA's NF4 base weights, dequantized by torchao: FSDP's shards joined in row order (its
    dim-0 split), a replica (DDP) or stage (PP) whole, every stage's; with the scaler block they
    were quantized in."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from torchtitan_amp.precision import lora

    out = {}
    for part in trainer.run.model_parts:
        for name, m in part.named_modules():  # an fp8 base (DDP / PP: whole): its codes and row scales
            if isinstance(m, lora.LoraLinear) and m.weight.dtype == torch.float8_e4m3fn:
                out[f"{name}.weight:fp8"] = m.weight.detach().view(torch.uint8).cpu()
                out[f"{name}.weight:scale"] = m.weight_scale.detach().cpu()
        for name, p in part.named_parameters():
            if lora.is_nf4(p):
                if isinstance(p, DTensor):  # each shard once, by its first row (HSDP's replicas repeat them)
                    local = p.to_local()
                    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    rows = dict(cast(list, _gather((offset[0], local.get_original_weight()))))
                    out[name] = torch.cat([rows[start] for start in sorted(rows)])
                else:
                    local = p
                    out[name] = local.get_original_weight().detach().cpu()
                out[f"{name}:scaler_block"] = torch.tensor(local.scaler_block_size)
    if trainer.run.dims.pp_enabled:
        out = {n: t for stage in _gather(out) for n, t in cast(dict, stage).items()}
    return out


@contextlib.contextmanager
def _full_init_max_params(limit: int | None):  # type: ignore[no-untyped-def]
    """train/job.py's full-init size set to `limit` while a Trainer builds (None: unchanged)."""
    from torchtitan_amp.train import job

    saved = job.FULL_INIT_MAX_PARAMS
    job.FULL_INIT_MAX_PARAMS = saved if limit is None else limit
    try:
        yield
    finally:
        job.FULL_INIT_MAX_PARAMS = saved


def _record_rows(trainer: Trainer) -> list[str]:
    """Digests of the input rows this rank's loader hands out, in order (the windows it trains on)."""
    rows: list[str] = []
    counted = trainer.run.dataloader._counted

    def recording(batches):  # type: ignore[no-untyped-def]
        for inputs, labels in counted(batches):
            rows.extend(digest(row)[:16] for row in inputs)
            yield inputs, labels

    trainer.run.dataloader._counted = recording
    return rows


def main(spec_path: str) -> int:
    spec = read_spec(spec_path)
    if spec.options.get("flavor"):
        from torchtitan_amp.models.llama3 import model as llama

        llama.LLAMA3_FLAVORS["debugmodel"] = dataclasses.replace(
            llama.LLAMA3_FLAVORS["debugmodel"], **spec.options["flavor"]
        )
    _install_test_hooks(spec.options)
    if any(job.get("hf_reads") for job in spec.jobs):
        _count_hf_reads()
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")  # the Trainers reuse it; ranks can agree before the first one
    preemption.install_preemption_handlers()
    for job in spec.jobs:
        if _rank() == 0:
            for src, dst in job.get("copy", []):
                shutil.copytree(src, dst)
        _barrier()
        if job.get("evaluate"):
            result = evaluate(job["args"])
            if _rank() == 0:
                Path(job["evaluate"]).write_text(json.dumps(result))
            continue
        if job.get("generate"):
            records = generate_texts(*parse_args(job["args"]))
            if _rank() == 0:
                Path(job["generate"]).write_text(json.dumps(records))
            continue
        if job.get("audit"):
            with _broken(job.get("break")):
                result = Trainer(load_config(job["args"])).audit()
            if _rank() == 0:
                Path(job["audit"]).write_text(json.dumps(result.to_json()))
            continue
        with _full_init_max_params(job.get("full_init_max_params")):
            trainer = Trainer(load_config(job["args"]))
        if job.get("perturb_rng"):
            torch.manual_seed(1000 + _rank())
            random.seed(2000 + _rank())
        if job.get("logits"):
            reads = _gather(_HF_READS[0])
            _HF_READS[0] = 0
            if job.get("hf_reads") and _rank() == 0:
                Path(job["hf_reads"]).write_text(json.dumps(reads))
            if job.get("attention_backend"):
                trainer.run.model.attention_backend = job["attention_backend"]
            logits = _logits(trainer, torch.tensor(job["tokens"]))
            if logits is not None and (_rank() == 0 or trainer.run.dims.pp_enabled):
                torch.save(logits.cpu(), job["logits"])
            trainer.run.metrics.close()
            continue
        if job.get("probe"):
            result = probe_trainer(trainer)
            if _rank() == 0:
                Path(job["probe"]).write_text(json.dumps(result))
            trainer.run.metrics.close()
            continue
        rows = _record_rows(trainer) if job.get("record_batches") else []
        trainer.train()
        if job.get("lora_grads"):
            result = _lora_grads(trainer, torch.tensor(job["tokens"]))
            if result is not None:
                torch.save(result, job["lora_grads"])
        if job.get("record_batches"):
            gathered = _gather([trainer.run.dataloader.dp_rank, rows])
            if _rank() == 0:
                Path(job["record_batches"]).write_text(json.dumps(gathered))
        if job.get("rng_out"):
            draws = _gather({"torch": torch.rand(4).tolist(), "python": random.random()})
            if _rank() == 0:
                Path(job["rng_out"]).write_text(json.dumps(draws))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1]))
