"""LoRA / QLoRA ([lora], precision/lora.py and lora_plan.py): the plan decides each part's dtypes
(the frozen base in the Linears' compute dtype or NF4, fp32 adapters), the report lists them, the
audit checks the adapters' gradients are fp32 and the base has none; bad targets are one line; a
LoRA model equals PEFT's on the same transformers model and init (loss and every adapter
gradient, fp32); merged and PEFT-format exports give our logits; a QLoRA step leaves its NF4 base
bit-identical. In-process only (no ranks launched)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan, lora
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--metrics.log_freq",
    "1",
    "--optimizer.lr",
    "1e-2",
    "--lora.enable",
]
BF16 = ["--mixed_precision.enabled", "true"]
FP32 = ["--mixed_precision.enabled", "false"]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _plan(*overrides: str, world: int = 1) -> PrecisionPlan:
    config = load_config([*BASE, *overrides])
    return PrecisionPlan.from_config(config, ParallelDims.from_config(config.parallelism, world), "cpu", probe=None)


def test_plan_decides_each_part() -> None:
    off = PrecisionPlan.from_config(load_config([]), ParallelDims.from_config(load_config([]).parallelism, 1), "cpu")
    assert off.lora is None
    bf16 = _plan(*BF16).lora
    assert bf16 is not None and (bf16.base_dtype, bf16.compute_dtype, bf16.adapter_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    fp32 = _plan(*FP32, "--lora.rank", "4", "--lora.alpha", "2").lora
    assert fp32 is not None and (fp32.base_dtype, fp32.adapter_dtype, fp32.scaling) == (
        torch.float32,
        torch.float32,
        0.5,
    )
    assert fp32.parts()["base"]["grad_dtype"] is None and fp32.parts()["adapters"]["grad_dtype"] == "float32"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--training.dtype", "bfloat16", *FP32], "trains fp32 master adapters"),
        (["--lora.quantize_base", "nf4", "--parallelism.tensor_parallel_degree", "2"], "one process"),
        (["--lora.quantize_base", "fp8", "--parallelism.data_parallel_shard_degree", "2"], "one process, DDP"),
        (["--lora.quantize_base", "fp8", "--parallelism.tensor_parallel_degree", "2"], "one process, DDP"),
        (["--lora.quantize_base", "fp8", "--mixed_precision.fp8", "tensorwise"], "fp8 / block_scaled"),
    ],
)
def test_what_cannot_run_is_one_line(overrides: list[str], message: str) -> None:
    world = 2 if any(o.endswith("degree") for o in overrides) else 1
    if "--parallelism.tensor_parallel_degree" in overrides and "fp8" in overrides:
        overrides = [*overrides, "--parallelism.data_parallel_shard_degree", "1"]
    with pytest.raises(PrecisionError, match=message) as e:
        _plan(*overrides, world=world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("layout", "world", "shards"),
    [
        (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 2, 1),
        (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 4, 2),
        (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 2, 1),
    ],
)
def test_qlora_plans_on_ddp_hsdp_and_pp(layout: list[str], world: int, shards: int) -> None:
    """QLoRA on DDP 2, HSDP 2 x 2 and PP 2: NF4 bases, split in blocks over FSDP's shard ranks only
    (a DDP replica or a pipeline stage holds each base whole; tests/test_hf.py trains them)."""
    got = _plan(*FP32, "--lora.quantize_base", "nf4", *layout, world=world).lora
    assert got is not None and got.nf4 and got.nf4_shards == shards


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("layers.*.attention.wz", "'layers.*.attention.wz' matches no module"),
        ("layers.*.attention_norm", "matches 'layers.0.attention_norm', a RMSNorm: LoRA adapts nn.Linear modules only"),
    ],
)
def test_bad_target_is_one_line(target: str, message: str) -> None:
    with pytest.raises(PrecisionError, match=message.replace("*", r"\*").replace(".", r"\.")) as e:
        job_mod.resolve(load_config([*BASE, *FP32, "--lora.target_modules", target]), 1, "cpu")
    assert "\n" not in str(e.value)


def test_bf16_lora_trains_adapters_only_and_passes_the_audit(tmp_path: Path) -> None:
    args = [*BASE, *BF16, "--training.steps", "3", "--job.dump_folder", str(tmp_path)]
    t = trainer_module.Trainer(load_config(args))
    named = dict(t.run.model.named_parameters())
    adapters = lora.adapter_parameters(t.run.model)
    assert set(adapters) == {
        f"layers.{i}.attention.w{w}.lora_{ab}.weight"
        for i in range(len(t.run.model.layers))
        for w in "qv"
        for ab in "AB"
    }
    assert all(p.requires_grad and p.dtype == torch.float32 for p in adapters.values())
    base = {n: p for n, p in named.items() if n not in adapters}
    assert not any(p.requires_grad for p in base.values())
    assert base["layers.0.attention.wq.weight"].dtype == base["layers.0.attention.wk.weight"].dtype == torch.bfloat16
    assert base["layers.0.attention_norm.weight"].dtype == torch.float32  # an fp32 island stays fp32
    before = {n: p.detach().clone() for n, p in base.items()}
    t.train()
    assert all(torch.equal(base[n], before[n]) and base[n].grad is None for n in base)
    assert {id(p) for p in t.run.optimizer.state} == {id(p) for p in adapters.values()}
    assert all(v.dtype == torch.float32 for s in t.run.optimizer.state.values() for v in s.values() if v.dim())
    assert any(adapters[n].abs().max() > 0 for n in adapters if ".lora_B." in n)  # B left zero: it learned
    report = json.loads((tmp_path / "precision_report.json").read_text())["lora"]
    assert report["base"] == {"storage_dtype": "bfloat16", "compute_dtype": "bfloat16", "grad_dtype": None}
    assert report["adapters"] == {"storage_dtype": "float32", "compute_dtype": "bfloat16", "grad_dtype": "float32"}
    assert len(report["adapted_modules"]) == 2 * len(t.run.model.layers)
    audited = trainer_module.Trainer(load_config([*args[:-1], str(tmp_path / "audit")])).audit()
    assert audited.ok, [str(b) for b in audited.breaches]


def test_audit_names_a_base_gradient_and_a_low_precision_adapter_gradient(tmp_path: Path) -> None:
    t = trainer_module.Trainer(load_config([*BASE, *BF16, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]))
    model = t.run.model
    wq = model.get_submodule("layers.0.attention.wq")
    wq.weight.grad = torch.zeros_like(wq.weight)
    wq.lora_A.weight.grad_dtype = None  # let a bf16 gradient in, as a broken path would leave it
    wq.lora_A.weight.grad = torch.zeros_like(wq.lora_A.weight, dtype=torch.bfloat16)
    seen = lora.audit(t.run.plan, [model])
    assert seen == {
        "adapter gradients": ["bfloat16"],
        "base parameters with a gradient": ["layers.0.attention.wq.weight"],
    }


# --- against PEFT, on the same transformers model and init (fp32) -------------------------------

HF_ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, use_scaled_rope=False)
TARGETS = "layers.*.attention.wq,layers.*.attention.wk,layers.*.feed_forward.w2"
PEFT_TARGETS = ["q_proj", "k_proj", "down_proj"]
TOKENS = torch.randint(0, 258, (2, 17), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random transformers LlamaForCausalLM (GQA), saved: the base both sides start from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchtitan_amp.models.llama3.model import ffn_hidden_dim

    config = LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=ffn_hidden_dim(64, 32, None),
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf_base")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _ours(folder: Path) -> tuple[torch.nn.Module, object]:
    """Our model imported from the HF folder, with fp32 adapters on TARGETS; B drawn at random (a
    zero B would leave A's gradient zero and the comparison empty)."""
    from torchtitan_amp.checkpoint.hf import load_hf
    from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer

    args = LlamaModelArgs(**HF_ARGS, vocab_size=258, max_seq_len=32)  # type: ignore[arg-type]
    model = Transformer(args)
    lora.apply_lora(_plan(*FP32, "--lora.target_modules", TARGETS, "--lora.alpha", "4"), model)
    load_hf(model, folder, args, complete_model=True)
    torch.manual_seed(1)
    lora.init_adapters(model)
    with torch.no_grad():
        for m in lora.lora_modules(model):
            m.lora_B.weight.normal_(0, 0.02)
    return model, args


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), TOKENS[:, 1:].flatten())


def test_loss_and_adapter_gradients_equal_peft(hf_folder: Path) -> None:
    import peft
    from transformers import LlamaForCausalLM

    from torchtitan_amp.checkpoint.hf import _adapter, permute_to_hf
    from torchtitan_amp.checkpoint.lora_export import peft_tensors
    from torchtitan_amp.models import get_family

    ours, args = _ours(hf_folder)
    base = LlamaForCausalLM.from_pretrained(hf_folder, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=4, lora_dropout=0.0, target_modules=PEFT_TARGETS)
    theirs = peft.get_peft_model(base, config)
    # Our A and B copied under PEFT's names (B's rows in HF's rotary layout for q / k): the export's mapping.
    mine = peft_tensors(ours, args)
    result = peft.set_peft_model_state_dict(theirs, mine)
    assert not result.unexpected_keys
    ours_loss = _loss(ours(TOKENS))
    ours_loss.backward()
    their_loss = _loss(theirs(input_ids=TOKENS).logits)
    their_loss.backward()
    ours_loss, their_loss = ours_loss.detach(), their_loss.detach()
    # fp32 both; the same products summed in other orders (fused attention vs eager, SwiGLU, the
    # rotary layouts): each side's rounding is at most ~n u |terms| with n <= 176 (the longest
    # reduction, the FFN's hidden width) and u = 2**-24, so 1e-5 relative (~176 u) bounds the gap.
    # Measured (torch 2.13 CPU, peft 0.21.2): losses bitwise equal, adapter gradients 7.6e-7 of their largest entry.
    assert abs(float(ours_loss) - float(their_loss)) <= 1e-5 * abs(float(their_loss))
    hf = _adapter(get_family("llama3"))
    named = {n: p for n, p in theirs.named_parameters() if "lora_" in n}
    assert len(named) == len(mine) == 2 * 3 * args.n_layers
    worst = 0.0
    for m_name, m in ours.named_modules():
        if not isinstance(m, lora.LoraLinear):
            continue
        module = hf.to_hf_name(f"{m_name}.weight").removesuffix(".weight")
        heads = hf.rotary_heads(f"{m_name}.weight", args)
        for ab in "AB":
            grad = getattr(m, f"lora_{ab}").weight.grad
            if ab == "B" and heads:
                grad = permute_to_hf(grad, heads)
            their = named[f"base_model.model.{module}.lora_{ab}.default.weight"].grad
            scale = float(their.abs().max())
            assert scale > 0, (m_name, ab)
            worst = max(worst, float((grad - their).abs().max()) / scale)
    assert worst <= 1e-5, worst


def test_merged_export_and_peft_adapters_give_our_logits(hf_folder: Path, tmp_path: Path) -> None:
    import peft
    from transformers import LlamaForCausalLM

    from torchtitan_amp.checkpoint.lora_export import export_merged_hf, export_peft

    ours, args = _ours(hf_folder)
    with torch.no_grad():
        want = ours(TOKENS)
    merged = LlamaForCausalLM.from_pretrained(export_merged_hf(ours, args, "llama3", tmp_path / "merged"))
    adapters = export_peft(ours, args, tmp_path / "peft", base_model=str(hf_folder))
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], len(config["target_modules"])) == (8, 4.0, 3 * args.n_layers)
    loaded = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_folder), adapters)
    with torch.no_grad():
        got_merged = merged(input_ids=TOKENS).logits
        got_peft = loaded(input_ids=TOKENS).logits
    # fp32 on both sides: the import's own tolerance (test_hf.py's LOGITS_ATOL); the merge adds one
    # rounding of W + s * B @ A (~u |W|). Measured: 1.5e-7 (merged) and 1.8e-7 (PEFT).
    assert (got_merged - want).abs().max() <= 1e-5
    assert (got_peft - want).abs().max() <= 1e-5
    base = LlamaForCausalLM.from_pretrained(hf_folder)
    with torch.no_grad():
        assert (base(input_ids=TOKENS).logits - want).abs().max() > 1e-3  # the adapters change the logits


# --- QLoRA ----------------------------------------------------------------------------------------


def _nf4_inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: getattr(t, n).clone() for n in t.__tensor_flatten__()[0]}


def test_qlora_step_leaves_the_nf4_base_bit_identical(tmp_path: Path) -> None:
    t = trainer_module.Trainer(
        load_config(
            [*BASE, *FP32, "--lora.quantize_base", "nf4", "--training.steps", "2", "--job.dump_folder", str(tmp_path)]
        )
    )
    model = t.run.model
    bases = {n: m.weight for n, m in model.named_modules() if isinstance(m, lora.LoraLinear)}
    assert bases and all(lora.is_nf4(w) and not w.requires_grad for w in bases.values())
    before = {n: _nf4_inner(w) for n, w in bases.items()}
    t.train()
    for n, w in bases.items():
        after = _nf4_inner(w)
        assert before[n].keys() == after.keys() and all(torch.equal(before[n][k], after[k]) for k in after), n
        assert w.grad is None
    assert any(float(m.lora_B.weight.abs().max()) > 0 for m in lora.lora_modules(model))  # the adapters learned
    report = json.loads((tmp_path / "precision_report.json").read_text())["lora"]
    assert report["base"]["storage_dtype"] == "nf4" and report["adapters"]["grad_dtype"] == "float32"


def _quantized_and_plain(quantize: str) -> dict[str, Any]:
    """Two tiny Llamas with the same init and adapters on TARGETS, fp32: under `quantize` (its base
    quantized by lora.quantize_base) and under "none"."""
    from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer

    args = LlamaModelArgs(**HF_ARGS, vocab_size=258, max_seq_len=32)  # type: ignore[arg-type]
    plans = {q: _plan(*FP32, "--lora.quantize_base", q, "--lora.target_modules", TARGETS) for q in (quantize, "none")}
    models: dict[str, Any] = {}
    for q, plan in plans.items():
        torch.manual_seed(0)
        models[q] = Transformer(args)
        models[q].init_weights()
        lora.apply_lora(plan, models[q])
        torch.manual_seed(1)
        lora.init_adapters(models[q])
    lora.quantize_base(plans[quantize], models[quantize])
    return models


def test_qlora_forward_is_lora_on_torchaos_dequantized_base() -> None:
    """Our QLoRA computes on torchao's dequantization (NF4Tensor.get_original_weight) and nothing of
    its own: its loss and adapter gradients equal, bitwise, a LoRA model whose fp32 base is that
    dequantized weight; the merge dequantizes the same way."""
    models = _quantized_and_plain("nf4")
    with torch.no_grad():
        for q_mod, f_mod in zip(lora.lora_modules(models["nf4"]), lora.lora_modules(models["none"])):
            deq = q_mod.weight.get_original_weight()
            assert deq.dtype == torch.float32 and not torch.equal(deq, f_mod.weight)  # NF4 rounds
            f_mod.weight.copy_(deq)
            q_mod.lora_B.weight.normal_(0, 0.02)
            f_mod.lora_B.weight.copy_(q_mod.lora_B.weight)
            assert torch.equal(q_mod.merged_weight(), f_mod.merged_weight())
    losses = {q: _loss(m(TOKENS)) for q, m in models.items()}
    for loss in losses.values():
        loss.backward()
    assert torch.equal(losses["nf4"], losses["none"])
    for q_mod, f_mod in zip(lora.lora_modules(models["nf4"]), lora.lora_modules(models["none"])):
        assert torch.equal(q_mod.lora_A.weight.grad, f_mod.lora_A.weight.grad)
        assert torch.equal(q_mod.lora_B.weight.grad, f_mod.lora_B.weight.grad)


def test_nf4_shape_torchao_cannot_quantize_is_one_line() -> None:
    with pytest.raises(PrecisionError, match="'layers.0.x.weight' has 100 elements, not a multiple of NF4's block"):
        lora.nf4_blocks("layers.0.x", 100)
    assert lora.nf4_blocks("w", 64 * 512) == (64, 256) and lora.nf4_blocks("w", 64 * 96) == (64, 32)
    # On FSDP each of torchao's inner tensors splits over the ranks: a whole number of scaler blocks each.
    assert lora.nf4_blocks("w", 64 * 32, 2) == (64, 16) and lora.nf4_blocks("w", 64 * 192, 2) == (64, 32)
    with pytest.raises(PrecisionError, match="'layers.0.x.weight' has 3 NF4 blocks, which 2 ranks do not split"):
        lora.nf4_blocks("layers.0.x", 64 * 3, 2)


def test_qlora_blocks_of_an_fsdp_split_are_recorded_for_the_export() -> None:
    """Where FSDP's split shrinks a weight's scaler block below one process's, base_dtypes records
    it, and nf4_of (what the export re-quantizes with) rebuilds the base bitwise."""
    import dataclasses

    from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer

    plan = _plan(*FP32, "--lora.quantize_base", "nf4", "--lora.target_modules", TARGETS)
    assert plan.lora is not None
    plan = dataclasses.replace(plan, lora=dataclasses.replace(plan.lora, nf4_shards=2))
    torch.manual_seed(0)
    model = Transformer(LlamaModelArgs(**HF_ARGS, vocab_size=258, max_seq_len=32))  # type: ignore[arg-type]
    model.init_weights()
    lora.apply_lora(plan, model)
    whole = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, lora.LoraLinear)}
    lora.quantize_base(plan, model)
    stored = lora.base_dtypes(model)
    for name, weight in whole.items():
        entry = stored[f"{name}.weight"]
        blocks = lora.nf4_blocks(name, weight.numel(), 2)
        assert entry == "nf4:float32" + ("" if blocks == lora.nf4_blocks(name, weight.numel()) else f":{blocks[1]}")
        rebuilt = lora.nf4_of(name, weight, entry).get_original_weight()
        assert torch.equal(rebuilt, model.get_submodule(name).weight.get_original_weight()), name
    assert any(entry.count(":") == 2 for entry in stored.values())


def test_qlora_without_torchaos_nf4_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # import fails: as if torchao lacked it
    with pytest.raises(PrecisionError, match="needs torchao's NF4Tensor") as e:
        lora.nf4_api()
    assert "\n" not in str(e.value)


# --- an fp8 base: float8_e4m3fn codes with fp32 row scales -----------------------------------------


def test_fp8_base_plans_on_ddp_and_pp_and_reports_its_dtypes() -> None:
    """quantize_base = 'fp8': the base stored float8_e4m3fn with fp32 row scales, dequantized to the
    compute dtype (bf16 here) for its matmul, no gradient; fp32 adapters; DDP 2 and PP 2 plan it."""
    got = _plan(*BF16, "--lora.quantize_base", "fp8").lora
    assert got is not None and got.fp8 and not got.nf4
    assert got.parts()["base"] == {
        "storage_dtype": "float8_e4m3fn",
        "scale_dtype": "float32",
        "compute_dtype": "bfloat16",
        "grad_dtype": None,
    }
    assert got.parts()["adapters"] == {"storage_dtype": "float32", "compute_dtype": "bfloat16", "grad_dtype": "float32"}
    for layout in (
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    ):
        lp = _plan(*FP32, "--lora.quantize_base", "fp8", *layout, world=2).lora
        assert lp is not None and lp.fp8


def test_fp8_row_error_is_within_e4m3s_bound() -> None:
    """rowwise_e4m3: scale = amax / 448 per row (fp32); e4m3 keeps 3 mantissa bits, so round to
    nearest moves a normal code (|w / s| >= 2^-6) by at most 2^-4 of itself and a subnormal one by at
    most half its 2^-9 spacing: |w - deq| <= 2^-4 |w| + s 2^-9 (the fp32 division and product add
    2^-24 relative, inside the slack of the subnormal term). Rows of very different magnitudes,
    and an all-zero row, which stays zero."""
    torch.manual_seed(0)
    w = torch.randn(6, 64) * torch.tensor([1e-4, 1e-2, 1.0, 30.0, 1e3, 0.0])[:, None]
    w[2, :8] = torch.tensor([1e-6, -1e-5, 3e-4, 2.0, -5.0, 0.0, 7e-3, 1e-3])  # codes of every size
    codes, scale = lora.rowwise_e4m3(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6, 1)
    assert torch.equal(scale[:5, 0], w[:5].abs().amax(dim=1) / 448)
    deq = lora.dequantize_e4m3(codes, scale, torch.float32)
    assert bool(((w - deq).abs() <= 2**-4 * w.abs() + scale * 2**-9).all())
    assert torch.equal(deq[5], torch.zeros(64)) and codes.float().abs().max() == 448
    codes2, scale2 = lora.rowwise_e4m3(w)  # deterministic
    assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scale2, scale)


def test_fp8_step_leaves_the_base_bit_identical_and_passes_the_audit(tmp_path: Path) -> None:
    t = trainer_module.Trainer(
        load_config(
            [*BASE, *BF16, "--lora.quantize_base", "fp8", "--training.steps", "2", "--job.dump_folder", str(tmp_path)]
        )
    )
    mods = lora.lora_modules(t.run.model)
    assert mods and all(m.weight.dtype == torch.float8_e4m3fn and not m.weight.requires_grad for m in mods)
    assert all(m.weight_scale.dtype == torch.float32 and m.compute_dtype == torch.bfloat16 for m in mods)
    before = [(m.weight.detach().view(torch.uint8).clone(), m.weight_scale.clone()) for m in mods]
    t.train()
    for m, (codes, scale) in zip(mods, before):
        assert torch.equal(m.weight.view(torch.uint8), codes) and torch.equal(m.weight_scale, scale)
        assert m.weight.grad is None
    assert any(float(m.lora_B.weight.detach().abs().max()) > 0 for m in mods)  # the adapters learned
    audit = lora.audit(t.run.plan, [t.run.model])
    assert audit == {"adapter gradients": ["float32"], "base parameters with a gradient": []}
    report = json.loads((tmp_path / "precision_report.json").read_text())["lora"]
    assert report["base"]["storage_dtype"] == "float8_e4m3fn" and report["base"]["scale_dtype"] == "float32"
    assert report["base"]["compute_dtype"] == "bfloat16" and report["adapters"]["grad_dtype"] == "float32"


def test_fp8_forward_is_lora_on_the_dequantized_base() -> None:
    """An fp8 base computes on its dequantization (codes * scale in fp32, rounded once to the compute
    dtype) and nothing else: loss and adapter gradients equal, bitwise, plain LoRA whose base is that
    dequantized weight; the merge dequantizes the same way."""
    models = _quantized_and_plain("fp8")
    with torch.no_grad():
        for q_mod, f_mod in zip(lora.lora_modules(models["fp8"]), lora.lora_modules(models["none"])):
            deq = q_mod.base_weight()
            assert deq.dtype == f_mod.weight.dtype and not torch.equal(deq, f_mod.weight)  # e4m3 rounds
            f_mod.weight.copy_(deq)
            q_mod.lora_B.weight.normal_(0, 0.02)
            f_mod.lora_B.weight.copy_(q_mod.lora_B.weight)
            assert torch.equal(q_mod.merged_weight(), f_mod.merged_weight())
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        losses = {"fp8": _loss(models["fp8"](TOKENS))}
    losses["none"] = _loss(models["none"](TOKENS))
    for loss in losses.values():
        loss.backward()
    assert torch.equal(losses["fp8"], losses["none"])
    # backward keeps the 1-byte codes, not a dequantized copy of any base
    # backward keeps the 1-byte codes (of every adapted Linear whose input needs a gradient: not
    # layer 0's wq and wk, fed by the frozen embedding), never a dequantized copy of a base
    deq = [m.base_weight() for m in lora.lora_modules(models["fp8"])]
    assert sum(t.dtype == torch.float8_e4m3fn for t in saved) == len(deq) - 2
    same = [(t, v) for t in saved for w in deq for v in (w, w.t()) if t.dtype == v.dtype and t.shape == v.shape]
    assert same and not any(torch.equal(t, v) for t, v in same)
    for q_mod, f_mod in zip(lora.lora_modules(models["fp8"]), lora.lora_modules(models["none"])):
        assert torch.equal(q_mod.lora_A.weight.grad, f_mod.lora_A.weight.grad)
        assert torch.equal(q_mod.lora_B.weight.grad, f_mod.lora_B.weight.grad)


# --- checkpoints: the adapters and their optimizer state, resumed bitwise -------------------------


def _run(folder: Path, *extra: str) -> trainer_module.Trainer:
    args = [*BASE, *FP32, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    t = trainer_module.Trainer(load_config([*args, "--job.dump_folder", str(folder), *extra]))
    t.train()
    return t


def _adapters(t: trainer_module.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora.adapter_parameters(t.run.model).items()}


@pytest.mark.parametrize("quantize", ["none", "fp8"])
def test_checkpoint_holds_adapters_and_resumes_bitwise(quantize: str, tmp_path: Path) -> None:
    """Also with an fp8 base: re-quantized from initial_load_path on resume, bitwise the same codes."""
    import shutil

    import torch.distributed.checkpoint as dcp

    # The base: another seed's weights as a seed checkpoint, so a resume that kept its own seed
    # init instead of reloading initial_load_path would train on a different base.
    seed = tmp_path / "base"
    trainer_module.Trainer(
        load_config(
            [*BASE[:-1], *FP32, "--training.seed", "5", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
            + ["--job.dump_folder", str(seed)]
        )
    ).train()
    base = ["--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]
    straight = _run(tmp_path / "straight", *base, "--lora.quantize_base", quantize)
    step2 = tmp_path / "straight" / "checkpoint" / "step-2"
    saved = dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys == {f"model.{n}" for n in lora.adapter_parameters(straight.run.model)}
    optim = {k for k in saved if k.startswith("optimizer.state.")}
    assert optim and all(".lora_A." in k or ".lora_B." in k for k in optim)
    meta = json.loads((step2 / "checkpoint.json").read_text())
    assert meta["lora_base"] == base[1]
    # Resume from step 2 of a copy (its step-4 removed) and train to step 4.
    resumed_folder = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoint", resumed_folder / "checkpoint")
    shutil.rmtree(resumed_folder / "checkpoint" / "step-4")
    resumed = _run(resumed_folder, *base, "--lora.quantize_base", quantize)
    want, got = _adapters(straight), _adapters(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    named = dict(resumed.run.model.named_parameters())
    for n, p in straight.run.model.named_parameters():
        # the base too: reloaded from initial_load_path (an fp8 base compared as its bits)
        assert p.dtype == named[n].dtype and torch.equal(p.view(torch.uint8), named[n].view(torch.uint8)), n
    if quantize == "fp8":
        import torch.distributed.checkpoint as dcp

        mods = dict(resumed.run.model.named_modules())
        fp8 = [n for n, m in mods.items() if isinstance(m, lora.LoraLinear)]
        assert fp8 and all(mods[n].weight.dtype == torch.float8_e4m3fn for n in fp8)
        for n in fp8:  # the rowwise e4m3 of the saved weight, in the compute dtype (fp32 here)
            saved_w = {"model": {f"{n}.weight": torch.empty(mods[n].weight.shape)}}
            dcp.load(saved_w, checkpoint_id=base[1], no_dist=True)
            codes, scale = lora.rowwise_e4m3(saved_w["model"][f"{n}.weight"])
            assert torch.equal(mods[n].weight.view(torch.uint8), codes.view(torch.uint8)), n
            assert torch.equal(mods[n].weight_scale, scale), n


# --- the memory model ---------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", ["none", "nf4", "fp8"])
def test_memory_model_counts_frozen_base_and_adapters_exactly(quantize: str) -> None:
    """memory.state_bytes on one process equals the built model: the frozen base in its storage
    (bf16 Linears, fp32 norms and embeddings; NF4's codes, scales and factors under QLoRA), the
    fp32 adapters with their fp32 gradients and AdamW moments, and nothing else trained."""
    from torchtitan_amp.memory.state import ADAMW_STEP_BYTES, state_bytes

    job = job_mod.resolve(load_config([*BASE, *BF16, "--lora.quantize_base", quantize]), 1, "cpu")
    model = job_mod.build_model_parts(job, torch.device("cpu"), [0]).parts[0]
    params: dict[str, int] = {}
    for p in model.parameters():
        key = "uint8" if lora.is_nf4(p) else str(p.dtype).removeprefix("torch.")
        inner = [getattr(p, n) for n in p.__tensor_flatten__()[0]] if lora.is_nf4(p) else [p]
        params[key] = params.get(key, 0) + sum(t.numel() * t.element_size() for t in inner)
    for m in lora.lora_modules(model):  # an fp8 base's fp32 row scales
        if hasattr(m, "weight_scale"):
            params["float32"] += m.weight_scale.numel() * 4
    adapters = sum(p.numel() for p in lora.adapter_parameters(model).values())
    got = state_bytes(job.model_dims, job.precision, job.layout)
    assert got.params == params, (got.params, params)
    assert got.grads == {"float32": 4 * adapters}
    assert got.optimizer == {"float32": 8 * adapters + ADAMW_STEP_BYTES * len(lora.adapter_parameters(model))}


@pytest.mark.parametrize("quantize", ["none", "nf4", "fp8"])
def test_dry_run_measures_what_the_memory_model_says(quantize: str, tmp_path: Path) -> None:
    """The dry run's meta model (NF4 quantized on meta by torchao) and memory.state_bytes agree."""
    from torchtitan_amp.train import dry_run

    config = load_config([*BASE, *BF16, "--lora.quantize_base", quantize, "--job.dump_folder", str(tmp_path)])
    report = dry_run.run(config, world_size=1, rank=0, write=False)
    assert report["memory"]["analytic_state_matches"], report["memory"]


def test_dry_run_on_fsdp_counts_the_adapters_for_reduce_and_checkpoint(tmp_path: Path) -> None:
    """FSDP 2 under LoRA (bf16 gathers, fp32 reduce): the frozen base is all-gathered but reduces
    nothing, so the reduce-scatter carries the A adapter parameters once (one call per block's
    adapter group), the largest block's buffers are its frozen Linears and adapters gathered twice
    plus the adapters' gradient and reduce input, and the checkpoint holds the adapters' shards and
    their AdamW state, not the base."""
    from torchtitan_amp.train import dry_run

    config = load_config(
        [*BASE, *BF16, "--parallelism.data_parallel_shard_degree", "2", "--job.dump_folder", str(tmp_path)]
    )
    report = dry_run.run(config, world_size=2, rank=0, write=False)
    m, r = report["model"], config.lora.rank
    kv = m["dim"] // m["n_heads"] * m["n_kv_heads"]
    per_block = r * (m["dim"] + m["dim"]) + r * (m["dim"] + kv)  # wq [dim, dim] and wv [kv, dim]
    base_block = m["dim"] * (2 * m["dim"] + 2 * kv) + 3 * m["dim"] * m["ffn_hidden"]
    adapters, tensors = per_block * m["n_layers"], 4 * m["n_layers"]
    assert report["communication"]["fsdp_reduce_scatter"] == {"float32": 4 * adapters}
    assert report["fsdp_collective_calls"]["fsdp_reduce_scatter"] == m["n_layers"]
    assert report["communication"]["fsdp_all_gather"]["bfloat16"] >= 2 * 2 * base_block * m["n_layers"]
    assert report["memory"]["transient"] == {
        "bfloat16": 2 * 2 * (base_block + per_block) + 2 * per_block,
        "float32": 4 * per_block,
    }
    assert report["memory"]["checkpoint"] == 4 * adapters // 2 + 8 * adapters // 2 + 4 * tensors


def test_qlora_base_from_initial_load_path_is_torchaos_nf4_of_it(tmp_path: Path) -> None:
    """The frozen base comes from checkpoint.initial_load_path into the NF4 parameters: each equals
    torchao's NF4 of the saved weight (torchao's NF4Tensor.copy_ quantizes what DCP loads)."""
    import torch.distributed.checkpoint as dcp

    seed = tmp_path / "base"
    trainer_module.Trainer(
        load_config(
            [*BASE[:-1], *FP32, "--training.seed", "5", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
            + ["--job.dump_folder", str(seed)]
        )
    ).train()
    step0 = seed / "checkpoint" / "step-0"
    t = trainer_module.Trainer(
        load_config(
            [*BASE, *FP32, "--lora.quantize_base", "nf4", "--training.steps", "1", "--checkpoint.enable"]
            + ["--checkpoint.initial_load_path", str(step0), "--job.dump_folder", str(tmp_path / "run")]
        )
    )
    t.train()  # one step: the frozen base does not move
    api = lora.nf4_api()
    for name, m in t.run.model.named_modules():
        if isinstance(m, lora.LoraLinear):
            saved = {"model": {f"{name}.weight": torch.empty(m.weight.shape)}}
            dcp.load(saved, checkpoint_id=str(step0), no_dist=True)
            want = api.to_nf4(saved["model"][f"{name}.weight"], *lora.nf4_blocks(name, m.weight.numel()))
            assert torch.equal(lora.dequantized(m.weight), lora.dequantized(want)), name


def test_adapters_of_an_fp32_by_name_linear_compute_in_fp32() -> None:
    job = job_mod.resolve(load_config([*BASE, *BF16, "--mixed_precision.fp32_module_names", "layers.0"]), 1, "cpu")
    model = job_mod.build_model_parts(job, torch.device("meta"), [0], materialize=False).parts[0]
    for i, want in ((0, torch.float32), (1, torch.bfloat16)):
        wq = model.get_submodule(f"layers.{i}.attention.wq")
        assert {job.plan.compute_dtype(m) for m in (wq, wq.lora_A, wq.lora_B)} == {want}, i
        assert wq.weight.dtype == want  # the frozen base in what it computes in


@pytest.mark.parametrize("quantize", ["none", "fp8"])
def test_a_lora_checkpoint_exports_merged_and_as_peft_from_the_command_line(quantize: str, tmp_path: Path) -> None:
    """`python -m torchtitan_amp.checkpoint export --format hf|peft` of a LoRA checkpoint (bf16 base
    from a seed-5 initial_load_path): it rebuilds the run's model bitwise (base in the dtypes it
    trained against, adapters), transformers gives the merged model's logits, and the PEFT folder
    holds every adapter."""
    from transformers import LlamaForCausalLM

    from torchtitan_amp.checkpoint.cli import main as checkpoint_cli
    from torchtitan_amp.checkpoint.lora_export import load_lora_checkpoint

    seed = tmp_path / "base"
    trainer_module.Trainer(
        load_config(
            [*BASE[:-1], *FP32, "--training.seed", "5", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
            + ["--job.dump_folder", str(seed)]
        )
    ).train()
    args = [*BASE, *BF16, "--training.steps", "2", "--checkpoint.enable", "--job.dump_folder", str(tmp_path / "run")]
    args += ["--lora.quantize_base", quantize]  # fp8: the export re-quantizes the bf16 base, then merges
    t = trainer_module.Trainer(load_config([*args, "--checkpoint.initial_load_path", str(seed / "checkpoint/step-0")]))
    t.train()
    step = tmp_path / "run" / "checkpoint" / "step-2"
    model, model_args, *_ = load_lora_checkpoint(step)
    want = dict(t.run.model.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    assert all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want
    )
    assert checkpoint_cli(["export", "--format", "hf", str(step), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert checkpoint_cli(["export", "--format", "peft", str(step), str(tmp_path / "peft")]) == 0
    from torchtitan_amp.models.llama3.model import Transformer

    merged = Transformer(model_args)
    merged.load_state_dict(lora.merge(model), strict=False)
    with torch.no_grad():
        ours = merged(TOKENS)
        theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf")(input_ids=TOKENS).logits
    assert (ours - theirs).abs().max() <= 1e-5  # fp32 both: test_hf.py's import tolerance
    from safetensors.torch import load_file

    assert len(load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))) == len(lora.adapter_parameters(model))


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_memory_model_fsdp_groups_are_the_dry_runs(quantize: str, tmp_path: Path, monkeypatch) -> None:
    """FSDP 2 under LoRA (bf16 gathers, fp32 reduce): the planner's groups (memory.fsdp_groups, what
    tools/plan_layout sizes layouts with) are the ones apply_fsdp creates on the meta model, which the
    dry run reads: per block the norms' fp32 group, the frozen Linears' group (gathered, never
    reduced) and the adapters' (gathered and reduced), and the root; so are the traffic and the
    transient buffers computed from them."""
    from torchtitan_amp import memory
    from torchtitan_amp.train import dry_run

    config = load_config(
        [*BASE, *BF16, "--lora.quantize_base", quantize, "--parallelism.data_parallel_shard_degree", "2"]
        + ["--job.dump_folder", str(tmp_path)]
    )
    real: list = []
    measured = dry_run.fsdp_groups_of
    monkeypatch.setattr(dry_run, "fsdp_groups_of", lambda *a, **k: real.append(measured(*a, **k)) or real[-1])
    dry_run.run(config, world_size=2, rank=0, write=False)
    job = job_mod.resolve(config, 2, "cpu")
    stage = memory.rank_stages(job.model_dims, job.layout, 0)[0]
    planned = memory.fsdp_groups(job.model_dims, job.precision, job.layout, stage)
    assert sorted(planned, key=lambda g: g.name) == sorted(real[0], key=lambda g: g.name)
    for f in (memory.fsdp_comm, memory.fsdp_transient, memory.fsdp_calls):
        assert f([(stage, planned)], job.layout) == f([(stage, real[0])], job.layout), f.__name__
