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
