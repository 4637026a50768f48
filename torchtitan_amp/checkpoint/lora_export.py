"""LoRA models out of a run (single process, the whole model in memory): merged into the base and
written as a Hugging Face folder through the family's export (`export_merged_hf`), or the adapters
alone in PEFT's format (`export_peft`: adapter_model.safetensors + adapter_config.json, PEFT's key
names, which `peft.PeftModel.from_pretrained` loads onto the base's Hugging Face model)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan_amp.checkpoint.format import EXPORT_FILE, FORMAT_VERSION, MARKER, dir_sizes
from torchtitan_amp.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, _adapter, export_hf, family_of, permute_to_hf
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.precision.lora import LoraLinear, lora_modules, merge

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model as base_model.model


def write_model_only(model: nn.Module, args: Any, family: str, folder: Path, tokenizer: str = "byte") -> Path:
    """The merged model as a model-only step folder (model.pt + its marker), what export_hf reads.

    Args:
        model: the whole LoRA model (one process).
        args: its model arguments, recorded for the export.
        family: its family's name (models.FAMILIES), recorded as model.name.
        folder: the step folder to write.
        tokenizer: the tokenizer spec recorded as model.tokenizer.
    """
    sd = merge(model)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(sd, folder / EXPORT_FILE)
    meta = {
        "format": FORMAT_VERSION,
        "step": 0,
        "kind": "model_only",
        "model_args": dataclasses.asdict(args),
        "job_config": {"model": {"name": family, "tokenizer": tokenizer}},
    }
    meta["files"] = dir_sizes(folder)
    (folder / MARKER).write_text(json.dumps(meta, indent=1))
    return folder


def export_merged_hf(
    model: nn.Module,
    args: Any,
    family: str,
    output: str | Path,
    dtype: str = "float32",
    tokenizer: str = "byte",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Merge every adapter into its base weight (W + scaling * B @ A, in fp32) and write the model as
    a Hugging Face folder of its family (checkpoint/hf.py's export_hf); returns the folder.

    Args:
        model: the whole LoRA model (one process).
        args: its model arguments.
        family: its family's name (models.FAMILIES).
        output: the Hugging Face folder to write.
        dtype: the dtype name the merged weights are written in.
        tokenizer: the tokenizer spec whose files are copied and whose ids config.json names.
        max_shard_bytes: the largest safetensors file, in bytes.
    """
    with tempfile.TemporaryDirectory() as tmp:
        step = write_model_only(model, args, family, Path(tmp) / "step-0", tokenizer)
        return export_hf(step, output, dtype, max_shard_bytes, tokenizer)


def peft_tensors(model: nn.Module, args: Any) -> dict[str, torch.Tensor]:
    """Our adapters under PEFT's names (base_model.model.<HF module>.lora_A/B.weight), fp32; B's rows
    in HF's rotary layout where the base weight's are (a row permutation of B @ A is one of B)."""
    hf = _adapter(family_of(args))
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, LoraLinear):
            continue
        key = f"{name}.weight"
        module = hf.to_hf_name(key).removesuffix(".weight")
        heads = hf.rotary_heads(key, args)
        b = m.lora_B.weight.detach().float()
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = m.lora_A.weight.detach().float().contiguous()
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (permute_to_hf(b, heads) if heads else b).contiguous()
    return out


def export_peft(model: nn.Module, args: Any, output: str | Path, base_model: str = "") -> Path:
    """The adapters alone, as PEFT saves them: adapter_model.safetensors and adapter_config.json;
    returns the folder.

    Args:
        model: the whole LoRA model (one process).
        args: its model arguments (the family's names and rotary layout).
        output: the folder to write.
        base_model: the base's path or hub name, recorded as base_model_name_or_path.
    """
    from safetensors.torch import save_file

    mods = lora_modules(model)
    if not mods:
        raise CheckpointError("the model has no LoRA adapters to export (lora.enable is off)")
    tensors = peft_tensors(model, args)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / PEFT_WEIGHTS), metadata={"format": "pt"})
    targets = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": mods[0].rank,
        "lora_alpha": mods[0].alpha,
        "lora_dropout": float(getattr(mods[0].lora_dropout, "p", 0.0)),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    if len({(m.rank, m.alpha) for m in mods}) != 1:
        raise CheckpointError("PEFT's adapter_config.json holds one rank and alpha; the adapters differ")
    (output / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return output


def _load_base(model: nn.Module, base: str, args: Any, flavor: str, family: Any) -> None:
    """The frozen base from the path a LoRA checkpoint names (an HF folder, one of our step
    folders or a model-only export); a seed init needs nothing (the model was initialised so)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_amp.checkpoint.format import quiet_single_process
    from torchtitan_amp.checkpoint.hf import load_hf
    from torchtitan_amp.checkpoint.loading import choose_initial
    from torchtitan_amp.precision.lora import adapter_parameters

    if base.startswith("seed init"):
        return
    choice = choose_initial(Path(base), args, flavor, family)
    adapters = set(adapter_parameters(model))
    if choice.kind == "hf":
        load_hf(model, Path(choice.path), args, complete_model=True, family=family)
        return
    sd = {k: v for k, v in model.state_dict().items() if k not in adapters}
    if choice.kind == "model_only":
        saved = torch.load(Path(choice.path) / EXPORT_FILE, map_location="cpu", weights_only=True)
        sd = {k: saved[k] for k in sd}
    else:
        with quiet_single_process():
            dcp.load({"model": sd}, checkpoint_id=choice.path, no_dist=True)
    model.load_state_dict(sd, strict=False)


def load_lora_checkpoint(step_dir: str | Path) -> tuple[nn.Module, Any, str, str, str]:
    """A LoRA checkpoint as the whole model on one process: its base (the manifest's lora_base, in
    the dtypes the adapters trained against: lora_base_dtypes, NF4 re-quantized by torchao, fp8 by rowwise_e4m3) plus
    its adapters. Returns (model, model args, family name, tokenizer spec, base)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_amp.checkpoint.format import checkpoint_family, inspect_checkpoint, quiet_single_process
    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.precision import PrecisionPlan
    from torchtitan_amp.precision.lora import adapter_parameters, apply_lora, nf4_of, to_fp8

    info = inspect_checkpoint(step_dir)
    base = info.meta.get("lora_base")
    if base is None:
        raise CheckpointError(f"{info.path} is not a LoRA checkpoint (its manifest names no lora_base)")
    family = checkpoint_family(info.meta)
    args = family.args_from_dict(info.meta["model_args"])
    job = info.meta["job_config"]
    lo = job["lora"]
    config = load_config(
        ["--model.name", family.name, "--mixed_precision.enabled", "false", "--lora.enable"]
        + ["--lora.rank", str(lo["rank"]), "--lora.alpha", str(lo["alpha"])]
        + ["--lora.target_modules", ",".join(lo["target_modules"])]
    )
    plan = PrecisionPlan.from_config(config, ParallelDims.from_config(config.parallelism, 1), "cpu", probe=None)
    with torch.device("meta"):
        model = family.build_model(args)
    apply_lora(plan, model)
    model.to_empty(device="cpu")
    torch.manual_seed(job["training"]["seed"])  # a seed-init base: as build_model_parts draws it
    with torch.no_grad():
        model.init_weights()
    _load_base(model, base, args, job["model"]["flavor"], family)
    adapters = {k: v.detach().clone() for k, v in adapter_parameters(model).items()}
    with quiet_single_process():
        dcp.load({"model": adapters}, checkpoint_id=str(info.path), no_dist=True)
    model.load_state_dict(adapters, strict=False)
    with torch.no_grad():  # round the base as the run stored it
        for name, module in model.named_modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                stored = info.meta.get("lora_base_dtypes", {}).get(f"{name}.{pname}" if name else pname)
                if stored is None:
                    continue
                rounded = p.detach().to(getattr(torch, stored.split(":")[1 if ":" in stored else 0]))
                if stored.startswith("nf4:"):
                    rounded = nf4_of(name, rounded, stored)
                module.register_parameter(pname, nn.Parameter(rounded, requires_grad=False))
                if stored.startswith("fp8:"):  # re-quantized as the run did: rowwise e4m3 of that base
                    to_fp8(module)
    return model, args, family.name, job["model"].get("tokenizer", "byte"), base
