"""gpt-oss's Hugging Face form: MXFP4 experts decoded by our block-scaled code against
transformers' own dequantization, wrong-shaped MXFP4 tensors refused in one line, and a
transformers-saved folder imported (plain and MXFP4 experts) with logits equal to transformers'."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.gpt_oss import sharpened_hf
from tests.test_gpt_oss import TOL
from torchtitan_amp.checkpoint import mxfp4
from torchtitan_amp.checkpoint.format import EXPORT_FILE, FORMAT_VERSION, MARKER
from torchtitan_amp.checkpoint.hf import INDEX, HFReader, check_config, export_hf, load_hf
from torchtitan_amp.core.errors import CheckpointError
from torchtitan_amp.models.gpt_oss import FAMILY
from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS, GptOssModelArgs, GptOssTransformer


def _random_mxfp4(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks and scales of a weight [..., rows, cols]: every byte, every finite scale."""
    g = torch.Generator().manual_seed(seed)
    *prefix, cols = shape
    blocks = torch.randint(0, 256, (*prefix, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (*prefix, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_transformers_bitwise(dtype: torch.dtype) -> None:
    """Every e2m1 code and every finite E8M0 scale (0..254, subnormal and overflowing products
    included): our decoding equals transformers' convert_moe_packed_tensors bit for bit in fp32;
    in bf16 on the scales whose products are bf16-normal (bf16's subnormals round)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 24, 128))
    if dtype == torch.bfloat16:
        scales = scales.clamp(10, 240)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = mxfp4.dequantize("w", blocks, scales, (3, 24, 128), dtype=dtype)
    assert ours.shape == theirs.shape == (3, 128, 24)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "change, message",
    [
        ("cols", r"holds a weight \[2, 8, 64\], the model's is \[2, 8, 96\]"),
        ("scales", r"are not \[\.\.\., rows, cols / 32, 16\]"),
        ("dtype", "must be uint8"),
    ],
)
def test_wrong_shaped_mxfp4_is_one_line(change: str, message: str) -> None:
    blocks, scales = _random_mxfp4((2, 8, 64))
    if change == "scales":
        scales = scales[..., :1]
    if change == "dtype":
        blocks = blocks.to(torch.int16)
    expected = (2, 8, 96) if change == "cols" else (2, 8, 64)
    with pytest.raises(CheckpointError, match=message) as e:
        mxfp4.dequantize("model.layers.0.mlp.experts.down_proj", blocks, scales, expected)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# A transformers-saved folder in, ours out, back into transformers

SEQ = 40


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """(args, transformers model, tokens, its logits, its save_pretrained folder in several shards)."""
    args = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64)
    model = sharpened_hf(args)
    folder = tmp_path_factory.mktemp("gpt_oss_hf")
    model.save_pretrained(folder, max_shard_size="300KB")
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return args, model, tokens, model(tokens).logits, folder


def _imported(folder: Path, args: GptOssModelArgs) -> GptOssTransformer:
    model = GptOssTransformer(args)
    model.init_weights()
    load_hf(model, folder, args, complete_model=True, family=FAMILY)
    return model.eval()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    return (ours - ref).abs().max().item() <= TOL * ref.abs().max().item()


def test_import_matches_transformers(saved) -> None:
    args, _, tokens, ref, folder = saved
    assert len(list(folder.glob("*.safetensors"))) > 2  # experts and their gate_up sources span shards
    check_config(folder, args, "debugmodel", FAMILY)
    with torch.no_grad():
        assert _close(_imported(folder, args)(tokens), ref)


def _mxfp4_folder(saved, folder: Path, cut: bool = False):
    """The saved folder with every expert weight replaced by random MXFP4 blocks and scales, and the
    transformers model given transformers' own dequantization of them (its logits returned)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    args, model, tokens, _, source = saved
    shutil.copytree(source, folder)
    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
            rows, cols = tensors[name].shape[-1], tensors[name].shape[-2]  # stored [E, rows, cols]
            g = torch.Generator().manual_seed(sum(map(ord, name)))
            blocks = torch.randint(
                0, 256, (tensors[name].shape[0], rows, cols // 32, 16), generator=g, dtype=torch.uint8
            )
            scales = torch.randint(123, 127, blocks.shape[:-1], generator=g, dtype=torch.uint8)
            with torch.no_grad():
                params[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            del tensors[name]
            if cut and "layers.1." in name:  # one block of 32 short along the reduction dim
                blocks, scales = blocks[..., :-1, :].contiguous(), scales[..., :-1].contiguous()
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        save_file(tensors, path, metadata={"format": "pt"})
    index = folder / INDEX
    meta = json.loads(index.read_text())
    for name, file in list(meta["weight_map"].items()):
        if name.endswith(("gate_up_proj", "down_proj")):
            del meta["weight_map"][name]
            meta["weight_map"].update({name + "_blocks": file, name + "_scales": file})
    index.write_text(json.dumps(meta))
    with torch.no_grad():
        return reference(tokens).logits


def test_import_of_mxfp4_experts_matches_transformers(saved, tmp_path: Path) -> None:
    """Experts stored as MXFP4 (as the released weights are): decoded by our block-scaled code,
    the logits equal those of transformers' model holding transformers' decoding of them."""
    args, _, tokens, _, _ = saved
    ref = _mxfp4_folder(saved, tmp_path / "mx")
    with torch.no_grad():
        assert _close(_imported(tmp_path / "mx", args)(tokens), ref)


def test_wrong_shaped_mxfp4_in_a_folder_is_one_line(saved, tmp_path: Path) -> None:
    args = saved[0]
    _mxfp4_folder(saved, tmp_path / "mx", cut=True)
    with pytest.raises(CheckpointError) as e:
        _imported(tmp_path / "mx", args)
    assert "layers.1" in str(e.value) and "\n" not in str(e.value)


def test_export_loads_in_transformers_with_our_logits(saved, tmp_path: Path) -> None:
    """Imported, its router and expert biases moved (so the export carries our values, not the
    import's), saved as a model-only checkpoint and exported: transformers loads every tensor with
    none missing or unexpected and gives our logits; config.json round-trips."""
    from transformers import GptOssForCausalLM

    args, _, tokens, _, folder = saved
    ours = _imported(folder, args)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(("experts.b1", "experts.b3", "router.bias")):
                p.add_(0.1 * torch.randn_like(p))
        logits = ours(tokens)
    step = tmp_path / "step-0"
    step.mkdir()
    torch.save(ours.state_dict(), step / EXPORT_FILE)
    marker = {
        "format": FORMAT_VERSION,
        "step": 0,
        "kind": "model_only",
        "files": {EXPORT_FILE: (step / EXPORT_FILE).stat().st_size},
        "model_args": dataclasses.asdict(args),
        "job_config": {"model": {"name": "gpt_oss", "tokenizer": "byte"}},
    }
    (step / MARKER).write_text(json.dumps(marker))
    out = export_hf(step, tmp_path / "out", dtype="float32", tokenizer="byte")
    check_config(out, args, "debugmodel", FAMILY)
    back, info = GptOssForCausalLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert _close(back.eval()(tokens).logits, logits)


def test_other_architecture_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match="'model_type' = 'llama'; only 'gpt_oss' can be loaded"):
        check_config(folder, GPT_OSS_FLAVORS["debugmodel"], "debugmodel", FAMILY)


def test_a_rank_reads_only_its_experts(saved, tmp_path: Path) -> None:
    """A slice of a derived expert tensor (what an FSDP or EP rank asks for: some experts, some
    columns) equals that slice of the whole, read from MXFP4 sources expert by expert."""
    from torchtitan_amp.checkpoint.hf_sources import DerivedSources

    args = saved[0]
    _mxfp4_folder(saved, tmp_path / "mx")
    reader = HFReader(tmp_path / "mx", args, False, FAMILY.hf)
    reader.read_metadata()
    sources: DerivedSources = reader.derived
    for fqn in ("layers.1.feed_forward.experts.w3", "layers.2.feed_forward.experts.w2"):
        shape = reader.read_metadata().state_dict_metadata[fqn].size
        whole = sources.read(fqn, [0, 0, 0], list(shape))
        part = sources.read(fqn, [3, 8, 16], [2, shape[1] - 8, 16])
        assert torch.equal(part, whole[3:5, 8:, 16:32])


def test_greedy_generation_equals_transformers_and_the_cache_equals_recompute(saved) -> None:
    """Our generation (a KV cache on every layer; the sinks and the 16-key window applied to the
    cached keys by position) on the imported model gives transformers' greedy tokens, token for
    token, over 40 positions (past twice the window, so that the sliding layers drop keys); each
    cached decode step's logits equal one forward over the whole text."""
    from torchtitan_amp.eval.generation import ModelRunner, generate, kv_caches, step_logits

    args, hf, _, _, folder = saved
    prompt, new = [256, *b"Hello"], 34
    ours = _imported(folder, args)
    completion = generate(ModelRunner(ours), prompt, new)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=257, pad_token_id=257
        )
    assert completion.tokens == theirs[0, len(prompt) :].tolist()
    tokens = prompt + completion.tokens
    runner = ModelRunner(ours)
    with torch.no_grad(), kv_caches(ours, len(tokens)) as caches:
        steps = [step_logits(runner, torch.tensor([prompt]), caches)]
        steps += [step_logits(runner, torch.tensor([[t]]), caches) for t in tokens[len(prompt) : -1]]
    with torch.no_grad():
        full = ours(torch.tensor([tokens]))[0, len(prompt) - 1 : -1]
    assert _close(torch.cat(steps), full)
