"""Hugging Face interop (checkpoint/hf.py, tokenizer folders), checked against transformers' own
LlamaForCausalLM: a tiny random one with GQA and Llama 3.1 rope scaling, built and saved here (no
download). Import gives transformers' logits on one process and on FSDP 2 / TP 2 / PP 2; an
export loads in transformers with no missing or unexpected keys and gives our logits; import ->
train 5 steps -> export -> reimport is bit for bit; bad folders fail in one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.hf import HFExport
from tests.support.launch import launch_worker, run_python
from torchtitan_amp.checkpoint.format import quiet_single_process
from torchtitan_amp.checkpoint.hf import (
    CONFIG,
    INDEX,
    check_config,
    export_hf,
    hf_config,
    load_hf,
    parse_size,
    permute_from_hf,
    permute_to_hf,
    rotary_rows,
)
from torchtitan_amp.core.errors import CheckpointError, DataError
from torchtitan_amp.data.tokenizer import build_tokenizer
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer, ffn_hidden_dim

pytestmark = pytest.mark.dist

# Rope scaling from position 16 on, so that it changes a 32-token sequence's logits (Llama 3.1
# scales from 8192, which a test-sized sequence would never reach); GQA: 4 query, 2 kv heads.
FLAVOR = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "multiple_of": 32,
    "rope_theta": 500000.0,
    "use_scaled_rope": True,
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position": 16,
}
ARGS = LlamaModelArgs(**FLAVOR, vocab_size=258, max_seq_len=32)
TOKENS = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(7))
LOGITS_ATOL = 1e-5  # fp32; measured max 1.5e-7 on one process
STEPS = 5
SPECIALS = ("<|start|>", "<|stop|>")  # in no default list: only tokenizer_config.json names them


def _hf_config(**changes):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    fields = dict(
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
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    return LlamaConfig(**{**fields, **changes})


HF_EXPORT = HFExport("LlamaForCausalLM", _hf_config, TOKENS, max_shard_size="40KB")  # conftest.py's `hf`


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """An HF tokenizer folder equivalent to a byte tokenizer (256 byte tokens, no merges) whose
    BOS/EOS names only its tokenizer_config.json gives: 258 tokens, the model's vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": SPECIALS[0]}, "eos_token": SPECIALS[1], "model_max_length": 32})
    )
    return folder


def _ours(folder: Path, args: LlamaModelArgs = ARGS) -> Transformer:
    model = Transformer(args)
    load_hf(model, folder, args, complete_model=True)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def test_permutation_round_trips_and_moves_rows():
    w = torch.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head dim 8
    assert torch.equal(permute_from_hf(permute_to_hf(w, 2), 2), w)
    # Our pair (x[2i], x[2i+1]) is HF's (x[i], x[i + 4]) within each head.
    assert permute_to_hf(w, 2)[:, 0].tolist() == [0, 6, 12, 18, 3, 9, 15, 21, 24, 30, 36, 42, 27, 33, 39, 45]


def test_rotary_rows_of_any_shard():
    """A shard boundary inside a head (FSDP's even split of 3 heads over 2 ranks, say) still gets
    each row's rotary partner: every row range equals the same rows of the whole permuted weight."""
    hf_weight = torch.randn(3 * 8, 5)  # 3 heads of head dim 8
    want = permute_from_hf(hf_weight, 3)
    for start in range(24):
        for length in range(1, 25 - start):
            got = rotary_rows(lambda rows: hf_weight[rows], 8, start, length)
            assert torch.equal(got, want[start : start + length]), (start, length)


def test_import_matches_transformers_on_one_process(hf):
    folder, _, reference = hf
    got = _logits(_ours(folder))
    assert (got - reference).abs().max() <= LOGITS_ATOL
    # The model exercises what the import must get right: without rope scaling (or with the
    # wrong rotary layout) the logits are far off.
    unscaled = dataclasses.replace(ARGS, use_scaled_rope=False)
    model = Transformer(unscaled)
    model.load_state_dict(_ours(folder).state_dict())
    assert (_logits(model) - reference).abs().max() > 100 * LOGITS_ATOL


def test_import_through_the_trainer_on_one_process(hf, tokenizer_folder, tmp_path, monkeypatch):
    """checkpoint.initial_load_path = the folder, through the checkpoint manager, one process."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train import trainer as trainer_module

    monkeypatch.setitem(
        llama.LLAMA3_FLAVORS, "debugmodel", dataclasses.replace(llama.LLAMA3_FLAVORS["debugmodel"], **FLAVOR)
    )
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)  # MFU is not read here
    trainer = trainer_module.Trainer(load_config(_job(tmp_path, hf[0], tokenizer_folder)))
    try:
        assert (_logits(trainer.run.model.eval()) - hf[2]).abs().max() <= LOGITS_ATOL
    finally:
        trainer.run.metrics.close()


def test_import_tied_embeddings(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(_hf_config(tie_word_embeddings=True)).eval()
    model.save_pretrained(tmp_path)
    ours = _ours(tmp_path)
    assert torch.equal(ours.output.weight, ours.tok_embeddings.weight)
    with torch.no_grad():
        assert (_logits(ours) - model(TOKENS).logits).abs().max() <= LOGITS_ATOL


def _job(dump: Path, hf_folder: Path, tokenizer: Path, *extra: str) -> list[str]:
    return [
        "--model.flavor",
        "debugmodel",
        "--model.tokenizer",
        str(tokenizer),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--mixed_precision.enabled",
        "false",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(hf_folder),
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


LAYOUTS = {
    "fsdp": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
}


LORA_STEP = ["--lora.enable", "--training.steps", "1", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1"]
COLWISE = ("attention.wq", "attention.wv")
QLORA = ["--lora.quantize_base", "nf4"]
LORA_BOTH_WAYS = [
    "--lora.target_modules",
    "layers.*.attention.wq,layers.*.attention.wv,layers.*.attention.wo,layers.*.feed_forward.w2",
]


# Context parallel 2 (FSDP shards over its 2 ranks): LoRA's runs only.
LORA_LAYOUTS = {
    **LAYOUTS,
    "cp": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "ddp": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
}


@pytest.fixture(scope="module")
def dist_run(hf, tokenizer_folder, tmp_path_factory) -> Path:
    """One 2-rank launch: import on FSDP 2, TP 2 and PP 2 (logits of TOKENS), then import on
    FSDP 2 and train STEPS steps with a full checkpoint at the end."""
    root = tmp_path_factory.mktemp("dist")
    folder = hf[0]
    jobs = [
        {
            "args": _job(root / layout, folder, tokenizer_folder, *extra),
            "logits": str(root / f"{layout}.pt"),
            "tokens": TOKENS.tolist(),
        }
        for layout, extra in LAYOUTS.items()
    ]
    jobs.append(
        {
            "args": _job(
                root / "train",
                folder,
                tokenizer_folder,
                *LAYOUTS["fsdp"],
                "--training.steps",
                str(STEPS),
                "--checkpoint.interval",
                str(STEPS),
                "--checkpoint.last_save_hf",
            )
        }
    )
    # LoRA from the folder: one step (B leaves zero), then the adapters' gradients of TOKENS; on
    # FSDP 2, on TP 2 (+SP) with column-wise (wq, wv) and row-wise (wo, w2) adapted bases, and
    # QLoRA (NF4 bases) on FSDP 2, also from a DCP checkpoint of the folder's weights (qlora_dcp).
    # QLoRA takes the path a model above the full-init size takes (built on meta, sharded, then
    # materialised: its NF4 base comes from the load only). QLoRA on DDP 2 and PP 2 takes that
    # size's path too (each rank or stage initialises its whole part, quantizes it, then loads).
    bases = {"qlora_dcp": root / "dcp_base", "qlora_export": _model_only_base(folder, root / "export_base")}
    with quiet_single_process():
        dcp.save({"model": _ours(folder).state_dict()}, checkpoint_id=str(bases["qlora_dcp"]), no_dist=True)
    jobs += [
        {
            "args": _job(
                root / name,
                bases.get(name, folder),
                tokenizer_folder,
                *LORA_LAYOUTS[layout],
                *LORA_STEP,
                *extra,
            ),
            "lora_grads": str(root / f"{name}.pt"),
            "tokens": TOKENS.tolist(),
            **({"full_init_max_params": 0} if name in ("qlora", "qlora_ddp", "qlora_pp", "lora_fp8_ddp") else {}),
        }
        for name, layout, extra in (
            ("lora", "fsdp", []),
            ("lora_tp", "tp", LORA_BOTH_WAYS),
            ("qlora", "fsdp", [*LORA_BOTH_WAYS, *QLORA]),
            ("qlora_dcp", "fsdp", [*LORA_BOTH_WAYS, *QLORA]),
            ("qlora_export", "fsdp", [*LORA_BOTH_WAYS, *QLORA]),
            ("lora_cp", "cp", LORA_BOTH_WAYS),
            ("qlora_cp", "cp", [*LORA_BOTH_WAYS, *QLORA]),
            ("qlora_ddp", "ddp", [*LORA_BOTH_WAYS, *QLORA]),
            ("qlora_pp", "pp", [*LORA_BOTH_WAYS, *QLORA]),
            ("lora_fp8_ddp", "ddp", [*LORA_BOTH_WAYS, "--lora.quantize_base", "fp8"]),
        )
    ]
    jobs += [_qlora_ddp_audit(root, folder, tokenizer_folder)]
    # tools/generate.py on 2 ranks (TP 2) from the trained step: greedy and seeded sampling.
    jobs += [
        {"generate": str(root / f"generate_tp_{name}.json"), "args": _generate_args(root, tokenizer_folder, *extra)}
        for name, extra in (("greedy", []), ("sampled", SAMPLED))
    ]
    launch_worker("ckpt_jobs", root, jobs, 2, flavor=FLAVOR)
    return root


QLORA_BF16 = ["--mixed_precision.enabled", "true", "--mixed_precision.reduce_dtype", "bfloat16"]


def _qlora_ddp_audit(root: Path, folder: Path, tokenizer_folder: Path) -> dict:
    """QLoRA on DDP 2 in bf16 with bf16 gradient reduction (the compress hook): the audit's
    record of one step's collectives."""
    args = _job(root / "qlora_ddp_audit", folder, tokenizer_folder, *LORA_LAYOUTS["ddp"], *LORA_STEP)
    return {"audit": str(root / "qlora_ddp_audit.json"), "args": [*args, *LORA_BOTH_WAYS, *QLORA, *QLORA_BF16]}


def _model_only_base(folder: Path, step: Path) -> Path:
    """A model-only export (model.pt and its marker) of the folder's weights, as a base to load."""
    from torchtitan_amp.checkpoint.format import EXPORT_FILE, FORMAT_VERSION, MARKER

    step.mkdir(parents=True)
    torch.save(_ours(folder).state_dict(), step / EXPORT_FILE)
    files = {EXPORT_FILE: (step / EXPORT_FILE).stat().st_size}
    (step / MARKER).write_text(json.dumps({"format": FORMAT_VERSION, "step": 0, "kind": "model_only", "files": files}))
    return step


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_matches_transformers_on_two_ranks(hf, dist_run, layout):
    got = torch.load(dist_run / f"{layout}.pt", weights_only=True)
    assert got.shape == hf[2].shape
    assert (got - hf[2]).abs().max() <= LOGITS_ATOL


def test_lora_on_fsdp_2_equals_peft(hf, dist_run):
    """LoRA (wq, wv; rank 8, alpha 16) trained one step on FSDP 2 from the folder: the loss of TOKENS
    and every adapter gradient equal PEFT's on transformers' model with the same adapters (fp32).
    Bound as tests/test_lora.py's one-process comparison (~176 u relative); measured (torch 2.13 CPU,
    gloo, peft 0.21.2): losses bitwise equal, gradients within 4.0e-7 of their largest entry."""
    import peft
    from transformers import LlamaForCausalLM

    from torchtitan_amp.checkpoint.hf import _adapter
    from torchtitan_amp.checkpoint.lora_export import peft_tensors
    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.models import get_family
    from torchtitan_amp.precision import PrecisionPlan, lora

    ours = torch.load(dist_run / "lora.pt", weights_only=True)
    config = load_config(["--lora.enable", "--mixed_precision.enabled", "false"])
    plan = PrecisionPlan.from_config(config, ParallelDims.from_config(config.parallelism, 1), "cpu", probe=None)
    model = Transformer(ARGS)
    lora.apply_lora(plan, model)
    model.load_state_dict(ours["values"], strict=False)
    assert any(float(v.abs().max()) > 0 for n, v in ours["values"].items() if ".lora_B." in n)
    theirs = peft.get_peft_model(
        LlamaForCausalLM.from_pretrained(hf[0], torch_dtype=torch.float32),
        peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    assert not peft.set_peft_model_state_dict(theirs, peft_tensors(model, ARGS)).unexpected_keys
    logits = theirs(input_ids=TOKENS).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), TOKENS[:, 1:].flatten())
    loss.backward()
    loss = loss.detach()
    assert abs(ours["loss"] - float(loss)) <= 1e-5 * float(loss)
    hf_names = _adapter(get_family("llama3"))
    named = {n: p for n, p in theirs.named_parameters() if "lora_" in n}
    assert len(named) == len(ours["grads"]) == 4 * ARGS.n_layers
    for key, grad in ours["grads"].items():
        module, ab = key.rsplit(".lora_", 1)
        heads = hf_names.rotary_heads(f"{module}.weight", ARGS)
        grad = permute_to_hf(grad, heads) if heads and ab.startswith("B") else grad
        peft_module = hf_names.to_hf_name(f"{module}.weight").removesuffix(".weight")
        their = named[f"base_model.model.{peft_module}.lora_{ab[0]}.default.weight"].grad
        assert (grad - their).abs().max() <= 1e-5 * their.abs().max(), key


def _one_process_lora(
    folder: Path, run: dict, *overrides: str, nf4_shards: int = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, fp32: the folder's base with the run's adapters (`overrides`: its [lora]
    options; QLoRA's NF4 in the blocks FSDP over `nf4_shards` ranks uses): the loss of TOKENS and
    every adapter's gradient of it."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.distributed.parallel_dims import ParallelDims
    from torchtitan_amp.precision import PrecisionPlan, lora

    config = load_config(["--lora.enable", "--mixed_precision.enabled", "false", *overrides])
    plan = PrecisionPlan.from_config(config, ParallelDims.from_config(config.parallelism, 1), "cpu", probe=None)
    assert plan.lora is not None
    plan = dataclasses.replace(plan, lora=dataclasses.replace(plan.lora, nf4_shards=nf4_shards))
    model = _ours(folder).train()
    lora.apply_lora(plan, model)
    model.load_state_dict(run["values"], strict=False)
    lora.quantize_base(plan, model)
    logits = model(TOKENS)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), TOKENS[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in lora.adapter_parameters(model).items()}


def _assert_lora_matches(run: dict, loss: torch.Tensor, grads: dict[str, torch.Tensor], bound: float) -> None:
    """The run's loss and each adapter gradient within `bound` (relative to the loss, and to each
    gradient's largest entry) of the one-process ones; B moved off zero in the run's step."""
    assert any(float(v.abs().max()) > 0 for n, v in run["values"].items() if ".lora_B." in n)
    assert run["grads"].keys() == grads.keys()
    assert abs(run["loss"] - float(loss)) <= bound * float(loss)
    for key, grad in run["grads"].items():
        assert (grad - grads[key]).abs().max() <= bound * grads[key].abs().max(), key


def test_lora_on_tp_2_equals_one_process(hf, dist_run):
    """LoRA on TP 2 with sequence parallel: wq / wv (column-wise: A replicated, B split by output
    rows) and wo / w2 (row-wise: A split by input columns, B replicated, one reduce of base + B(A x))
    after one step: the loss of TOKENS and every adapter gradient equal one process fp32's with the
    same adapters. Bound: the row-wise partial sums add in another order than one process's matmul,
    a few fp32 ulps per sum over 64 to 192 terms (1e-5 relative, as the FSDP comparison); measured
    (torch 2.13 CPU, gloo): losses bitwise equal, gradients within 7.1e-7 of their largest entry."""
    run = torch.load(dist_run / "lora_tp.pt", weights_only=True)
    assert len(run["grads"]) == 2 * 4 * ARGS.n_layers
    _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS), 1e-5)


def test_lora_on_cp_2_equals_one_process(hf, dist_run):
    """LoRA (wq, wv, wo, w2) and QLoRA trained one step on context parallel 2 (the adapters are
    Linears on each rank's chunks of the sequence; only attention gathers K/V): the loss of TOKENS
    and the adapter gradients, each rank's chunks through the trainer's step, equal one process
    fp32's with the same adapters (QLoRA's NF4 in FSDP 2's blocks: FSDP shards over the cp ranks).
    Bound as the FSDP rows (1e-5); measured (torch 2.13 CPU, gloo): LoRA's loss within 8.6e-8
    relative, QLoRA's bitwise equal, gradients within 5.5e-7 of their largest entry."""
    for name, extra, shards in (("lora_cp", (), 1), ("qlora_cp", QLORA, 2)):
        run = torch.load(dist_run / f"{name}.pt", weights_only=True)
        _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS, *extra, nf4_shards=shards), 1e-5)


FSDP_X_TP = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]


@pytest.fixture(scope="module")
def fsdp_x_tp_run(hf, tokenizer_folder, tmp_path_factory) -> Path:
    """One 4-rank launch on FSDP 2 x TP 2: the import's logits of TOKENS, then LoRA's step as
    dist_run's TP row; and QLoRA's step on HSDP 2 x 2."""
    root = tmp_path_factory.mktemp("fsdp_x_tp")
    jobs = [
        {
            "args": _job(root / "run", hf[0], tokenizer_folder, *FSDP_X_TP),
            "logits": str(root / "logits.pt"),
            "tokens": TOKENS.tolist(),
            "hf_reads": str(root / "reads.json"),
        },
        {
            "args": _job(root / "lora", hf[0], tokenizer_folder, *FSDP_X_TP, *LORA_STEP, *LORA_BOTH_WAYS),
            "lora_grads": str(root / "lora.pt"),
            "tokens": TOKENS.tolist(),
        },
        {
            "args": _job(root / "qlora_hsdp", hf[0], tokenizer_folder, *HSDP, *LORA_STEP, *LORA_BOTH_WAYS, *QLORA),
            "lora_grads": str(root / "qlora_hsdp.pt"),
            "tokens": TOKENS.tolist(),
        },
    ]
    launch_worker("ckpt_jobs", root, jobs, 4, flavor=FLAVOR)
    return root


def test_qlora_on_fsdp_2_equals_one_process(hf, dist_run):
    """QLoRA (NF4 bases of wq, wv, wo, w2, quantized on meta and split by FSDP, whose all-gather
    goes through NF4Tensor's fsdp_pre/post_all_gather; the load reads each weight whole, quantizes
    it and keeps the rank's rows), built as a model above the full-init size is (on meta, sharded,
    then materialised, the NF4 bases left to the load), from the folder and from a DCP checkpoint
    and a model-only export of its weights (each rank reads every base weight whole there too),
    after one step on FSDP 2:
    every base, its shards dequantized and joined, is bitwise torchao's NF4 of the folder's weight (the step left it
    unchanged, and the shards are one quantization, not one per rank), and the loss of TOKENS and
    the adapter gradients equal one process QLoRA's with the same blocks. Bound as the FSDP rows
    (1e-5); measured (torch 2.13 CPU, gloo): loss and every gradient bitwise equal."""
    from torchtitan_amp.precision import lora

    reference = _ours(hf[0]).state_dict()
    for job in ("qlora", "qlora_dcp", "qlora_export"):  # from the folder, a DCP checkpoint, a model-only export
        run = torch.load(dist_run / f"{job}.pt", weights_only=True)
        bases = [n for n in run["nf4"] if not n.endswith(":scaler_block")]
        assert len(bases) == 4 * ARGS.n_layers
        for name in bases:
            blocks = lora.nf4_blocks(name, reference[name].numel(), 2)
            assert int(run["nf4"][f"{name}:scaler_block"]) == blocks[1]
            want = lora.nf4_api().to_nf4(reference[name], *blocks).get_original_weight()
            assert torch.equal(run["nf4"][name], want), (job, name)
        _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS, *QLORA, nf4_shards=2), 1e-5)


def _assert_nf4_bases(run: dict, folder: Path, shards: int) -> None:
    """Every NF4 base of the run (wq, wv, wo, w2 of each block), dequantized, is bitwise torchao's
    NF4 of the folder's weight in the blocks a split over `shards` ranks uses."""
    from torchtitan_amp.precision import lora

    reference = _ours(folder).state_dict()
    bases = [n for n in run["nf4"] if not n.endswith(":scaler_block")]
    assert len(bases) == 4 * ARGS.n_layers
    for name in bases:
        blocks = lora.nf4_blocks(name, reference[name].numel(), shards)
        assert int(run["nf4"][f"{name}:scaler_block"]) == blocks[1]
        assert torch.equal(run["nf4"][name], lora.nf4_api().to_nf4(reference[name], *blocks).get_original_weight()), (
            name
        )


def test_qlora_on_ddp_2_equals_one_process(hf, dist_run):
    """QLoRA on DDP 2 (each rank the whole NF4 model, built as a model above the full-init size
    is; DDP's reducer holds the adapters only, and its broadcast, which would requantize the NF4
    bases, is off) after one step: every base is
    bitwise torchao's NF4 of the folder's weight, and the loss of TOKENS and every adapter gradient
    are bitwise one process QLoRA's (both ranks compute the same tokens: the mean of two equal fp32
    gradients is each). In bf16 with the bf16 compress hook (the audit's record of a step), the
    gradient all-reduce carries the adapters' gradients, 2 bytes each, and nothing of the base.
    Measured (torch 2.13 CPU, gloo): loss and gradients bitwise; 19456 bf16 bytes, 9728 adapters."""
    run = torch.load(dist_run / "qlora_ddp.pt", weights_only=True)
    _assert_nf4_bases(run, hf[0], 1)
    _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS, *QLORA), 0.0)
    adapters = sum(g.numel() for g in run["grads"].values())
    audit = json.loads((dist_run / "qlora_ddp_audit.json").read_text())
    assert audit["collectives"]["all_reduce:dp_replicate"]["bfloat16"] == 2 * adapters, audit["collectives"]


def test_lora_fp8_base_on_ddp_2_equals_one_process(hf, dist_run):
    """An fp8 base on DDP 2 (each rank the whole model, built as a model above the full-init size
    is, then the folder's weights loaded and re-quantized; DDP's broadcast is off, the reducer
    holds the adapters only) after one step: every base is bitwise the rowwise e4m3 of the folder's
    weight (codes and fp32 scales), and the loss of TOKENS and every adapter gradient are bitwise
    one process's with the same fp8 base (both ranks compute the same tokens)."""
    from torchtitan_amp.precision import lora

    run = torch.load(dist_run / "lora_fp8_ddp.pt", weights_only=True)
    reference = _ours(hf[0]).state_dict()
    bases = [n.removesuffix(":fp8") for n in run["nf4"] if n.endswith(":fp8")]
    assert len(bases) == 4 * ARGS.n_layers
    for name in bases:
        codes, scale = lora.rowwise_e4m3(reference[name])
        assert torch.equal(run["nf4"][f"{name}:fp8"], codes.view(torch.uint8)), name
        assert torch.equal(run["nf4"][f"{name}:scale"], scale), name
    _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS, "--lora.quantize_base", "fp8"), 0.0)


def test_qlora_on_pp_2_equals_one_process(hf, dist_run):
    """QLoRA on PP 2 (each stage its blocks' NF4 bases: the stage split shares them, as torchao's
    clone would requantize; built as a model above the full-init size is) after one step: every
    base is bitwise torchao's NF4 of the folder's weight, and the loss of TOKENS (the trainer's
    pipeline step, two microbatches) and every adapter gradient equal one process QLoRA's. Bound
    as the FSDP rows (1e-5): the microbatches' losses and gradients add in another order than one
    batch's; measured (torch 2.13 CPU, gloo): loss bitwise equal, gradients within 3.3e-7 of their
    largest entry."""
    run = torch.load(dist_run / "qlora_pp.pt", weights_only=True)
    assert len(run["grads"]) == 2 * 4 * ARGS.n_layers
    _assert_nf4_bases(run, hf[0], 1)
    _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS, *QLORA), 1e-5)


def test_qlora_on_hsdp_2x2_equals_one_process(hf, fsdp_x_tp_run):
    """QLoRA on HSDP (2 replicas of FSDP 2; the NF4 bases split over dp_shard, each replica a whole
    copy) after one step: every base, each shard once, is bitwise torchao's NF4 of the folder's
    weight in FSDP 2's blocks, and the loss of TOKENS and every adapter gradient equal one process
    QLoRA's with those blocks. Bound as the FSDP rows (1e-5); measured (torch 2.13 CPU, gloo): loss
    and every gradient bitwise equal."""
    run = torch.load(fsdp_x_tp_run / "qlora_hsdp.pt", weights_only=True)
    _assert_nf4_bases(run, hf[0], 2)
    _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS, *QLORA, nf4_shards=2), 1e-5)


def test_import_matches_transformers_on_fsdp_x_tp(hf, fsdp_x_tp_run):
    """FSDP 2 x TP 2 (4 ranks): 2-D DTensors, FSDP sharding TP's column shards of q and k again
    (one head per rank)."""
    tmp_path = fsdp_x_tp_run
    assert (torch.load(tmp_path / "logits.pt", weights_only=True) - hf[2]).abs().max() <= LOGITS_ATOL
    # No rank read the whole model: each read about its quarter (norms are sharded by FSDP only,
    # so a little more), and together the ranks read each element about once.
    reads, total = json.loads((tmp_path / "reads.json").read_text()), sum(p.numel() for p in hf[1].parameters())
    assert all(0 < r < 0.3 * total for r in reads) and total <= sum(reads) < 1.05 * total, (reads, total)


def test_lora_on_fsdp_2_x_tp_2_equals_one_process(hf, fsdp_x_tp_run):
    """As the TP 2 row, with FSDP sharding the adapters' TP shards again (2-D DTensors); the same
    bound; measured (torch 2.13 CPU, gloo): losses bitwise equal, gradients within 6.7e-7 of their largest entry."""
    run = torch.load(fsdp_x_tp_run / "lora.pt", weights_only=True)
    _assert_lora_matches(run, *_one_process_lora(hf[0], run, *LORA_BOTH_WAYS), 1e-5)
    assert run["placements"]["layers.0.attention.wo.lora_A.weight"] == "(Shard(dim=0), Shard(dim=1))"


def _checkpoint_model(step_dir: Path) -> dict[str, torch.Tensor]:
    sd = Transformer(ARGS).state_dict()
    with quiet_single_process():
        dcp.load({"model": sd}, checkpoint_id=str(step_dir), no_dist=True)
    return sd


@pytest.fixture(scope="module")
def exported(dist_run, tmp_path_factory) -> Path:
    """The trained run's last checkpoint exported by the CLI, in fp32, in shards of <= 50 kB."""
    out = tmp_path_factory.mktemp("export") / "hf"
    result = run_python(
        "-m",
        "torchtitan_amp.checkpoint",
        "export",
        "--format",
        "hf",
        str(dist_run / "train" / "checkpoint" / f"step-{STEPS}"),
        str(out),
        "--dtype",
        "float32",
        "--max-shard-size",
        "50kB",
    )
    assert result.returncode == 0, result.describe()
    return out


def test_export_loads_in_transformers_with_our_logits(dist_run, exported, tokenizer_folder):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained = Transformer(ARGS)
    trained.load_state_dict(_checkpoint_model(dist_run / "train" / "checkpoint" / f"step-{STEPS}"))
    with torch.no_grad():
        assert (model.eval()(TOKENS).logits - _logits(trained.eval())).abs().max() <= LOGITS_ATOL
    # Shards of the chosen size and an index naming every tensor; the run's tokenizer files.
    index = json.loads((exported / INDEX).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in exported.glob("*.safetensors")}
    assert len(index["weight_map"]) == len(trained.state_dict())
    assert all(
        p.stat().st_size <= 50_000 + 8192
        for p in exported.glob("*.safetensors")
        if len([k for k, v in index["weight_map"].items() if v == p.name]) > 1
    )
    assert (exported / "tokenizer.json").read_bytes() == (tokenizer_folder / "tokenizer.json").read_bytes()
    cfg = json.loads((exported / CONFIG).read_text())
    tok = build_tokenizer(str(tokenizer_folder))
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_id, tok.eos_id) == (256, 257)


def test_import_train_export_reimport_is_bitwise(hf, dist_run, exported):
    saved = _checkpoint_model(dist_run / "train" / "checkpoint" / f"step-{STEPS}")
    again = _ours(exported).state_dict()
    assert saved.keys() == again.keys()
    for key in saved:
        assert torch.equal(saved[key], again[key]), key
    # The run's own export at its end (checkpoint.last_save_hf) holds the same weights.
    at_end = _ours(dist_run / "train" / "checkpoint" / f"hf-step-{STEPS}").state_dict()
    assert all(torch.equal(saved[key], at_end[key]) for key in saved)
    # Training moved the weights: the round trip is not the imported weights compared to themselves.
    assert not torch.equal(
        saved["layers.0.attention.wq.weight"], _ours(hf[0]).state_dict()["layers.0.attention.wq.weight"]
    )
    # The run logged STEPS steps from the imported weights.
    rows = [json.loads(line) for line in (dist_run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))


def test_export_in_bf16_single_file(dist_run, tmp_path):
    from safetensors import safe_open

    out = export_hf(
        dist_run / "train" / "checkpoint" / f"step-{STEPS}", tmp_path / "bf16", "bfloat16", tokenizer="byte"
    )
    assert not (out / INDEX).exists() and [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / CONFIG).read_text())["torch_dtype"] == "bfloat16"
    assert not (out / "tokenizer.json").exists()
    # Imported into fp32 parameters: exactly the trained weights rounded to bf16.
    saved = _checkpoint_model(dist_run / "train" / "checkpoint" / f"step-{STEPS}")
    again = _ours(out).state_dict()
    assert all(torch.equal(again[k], saved[k].to(torch.bfloat16).float()) for k in saved)


def _model_only_export(full: Path, step: Path) -> Path:
    """The step folder a last_save_model_only save writes (model.pt and its marker), from `full`."""
    from torchtitan_amp.checkpoint.format import EXPORT_FILE, MARKER, export_checkpoint

    export_checkpoint(full, step / EXPORT_FILE)
    meta = {k: v for k, v in json.loads((full / MARKER).read_text()).items() if k != "crc32"}
    (step / MARKER).write_text(
        json.dumps({**meta, "kind": "model_only", "files": {EXPORT_FILE: (step / EXPORT_FILE).stat().st_size}})
    )
    return step


def test_export_of_a_model_only_checkpoint(dist_run, tmp_path):
    """A last_save_model_only export (model.pt, memory-mapped) converts as a DCP checkpoint does."""
    full = dist_run / "train" / "checkpoint" / f"step-{STEPS}"
    step = _model_only_export(full, tmp_path / f"step-{STEPS}")
    out = export_hf(step, tmp_path / "hf", "float32", tokenizer="byte")
    saved, again = _checkpoint_model(full), _ours(out).state_dict()
    assert all(torch.equal(saved[k], again[k]) for k in saved)


@pytest.mark.parametrize("flavor", ["debugmodel", "llama3_8b", "llama3_70b"])
def test_exported_config_describes_its_flavor(flavor, tmp_path):
    args = llama.build_model_args(flavor, 128256, 8192)
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(args, "bfloat16", 128000, 128001)))
    check_config(tmp_path, args, flavor)


def test_published_llama_3_1_8b_config_fits_llama3_8b(tmp_path):
    """config.json of meta-llama/Llama-3.1-8B as published (transformers 4.43 spelling)."""
    (tmp_path / CONFIG).write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "attention_bias": False,
                "attention_dropout": 0.0,
                "bos_token_id": 128000,
                "eos_token_id": 128001,
                "hidden_act": "silu",
                "hidden_size": 4096,
                "initializer_range": 0.02,
                "intermediate_size": 14336,
                "max_position_embeddings": 131072,
                "mlp_bias": False,
                "model_type": "llama",
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "pretraining_tp": 1,
                "rms_norm_eps": 1e-05,
                "rope_scaling": {
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "rope_type": "llama3",
                },
                "rope_theta": 500000.0,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "use_cache": True,
                "vocab_size": 128256,
            }
        )
    )
    check_config(tmp_path, llama.build_model_args("llama3_8b", 128256, 8192), "llama3_8b")
    with pytest.raises(CheckpointError, match="'hidden_size' = 4096 but model.flavor 'llama3_70b' has dim = 8192"):
        check_config(tmp_path, llama.build_model_args("llama3_70b", 128256, 8192), "llama3_70b")


def test_tokenizer_folder(tokenizer_folder, tmp_path):
    tok = build_tokenizer(str(tokenizer_folder))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    ids = tok.encode("héllo", bos=True, eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and tok.decode(ids) == "héllo"
    # Without tokenizer_config.json no known BOS name is in this vocabulary.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tokenizer_folder / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="no BOS/EOS special token"):
        build_tokenizer(str(bare))
    (bare / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>", "eos_token": SPECIALS[1]}))
    with pytest.raises(DataError, match="'bos_token' '<nope>' is not in the vocabulary"):
        build_tokenizer(str(bare))
    with pytest.raises(DataError, match="has no tokenizer.json"):
        build_tokenizer(str(tmp_path))


def test_data_prepare_with_a_tokenizer_folder(tokenizer_folder, tmp_path, capsys):
    """The prepare step takes the folder too; its fingerprint carries the folder's BOS/EOS, so the
    shards cannot be mistaken for ones made with the bare tokenizer.json's defaults."""
    from torchtitan_amp.data.cli import main as data_main

    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    out = tmp_path / "tokens"
    assert (
        data_main(
            [
                "prepare",
                str(tmp_path / "a.txt"),
                "--output",
                str(out),
                "--tokenizer",
                str(tokenizer_folder),
                "--no-progress",
            ]
        )
        == 0
    )
    assert data_main(["verify", str(out), "--tokenizer", str(tokenizer_folder), "--no-progress"]) == 0
    assert build_tokenizer(str(tokenizer_folder)).fingerprint.endswith(":bos256:eos257")
    assert data_main(["verify", str(out), "--tokenizer", "byte", "--no-progress"]) == 2
    assert "error:" in capsys.readouterr().err


def _copy(folder: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in folder.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_config(folder: Path, **changes) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(
    "break_it, message",
    [
        (
            lambda f: _edit_config(f, num_hidden_layers=3),
            r"'num_hidden_layers' = 3 but model.flavor 'x' has n_layers = 2",
        ),
        (lambda f: _edit_config(f, vocab_size=300), r"'vocab_size' = 300 but the tokenizer \(model.tokenizer\)"),
        (lambda f: _edit_config(f, num_key_value_heads=4), r"'num_key_value_heads' = 4"),
        (
            lambda f: _edit_config(f, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
            r"'rope_scaling' = none but model.flavor 'x' has use_scaled_rope = True",
        ),
        (
            lambda f: _edit_config(
                f, rope_parameters={**json.loads((f / CONFIG).read_text())["rope_parameters"], "factor": 32.0}
            ),
            r"'rope_scaling.factor' = 32.0 but model.flavor 'x' has rope_scaling_factor = 8.0",
        ),
        (
            lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            r"rope scaling type 'yarn' is not supported",
        ),
        (lambda f: _edit_config(f, model_type="mistral"), r"'model_type' = 'mistral'; only 'llama'"),
        (lambda f: (f / CONFIG).write_text("{not json"), r"config.json is unreadable"),
    ],
)
def test_mismatched_config_is_one_line(hf, tmp_path, break_it, message):
    folder = _copy(hf[0], tmp_path / "hf")
    break_it(folder)
    with pytest.raises(CheckpointError, match=message) as e:
        check_config(folder, ARGS, "x")
    assert "\n" not in str(e.value)


def _truncate_a_shard(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])


def _drop_a_shard(folder: Path) -> None:
    sorted(folder.glob("*.safetensors"))[0].unlink()


def _rename_a_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    shard = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    save_file({k.replace("model.", "model.decoder.", 1): v for k, v in tensors.items()}, str(shard))


def _drop_every_shard(folder: Path) -> None:
    for p in [*folder.glob("*.safetensors"), folder / INDEX]:
        p.unlink()


def _shrink_a_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / INDEX).read_text())["weight_map"]
    shard = folder / index["model.layers.1.mlp.up_proj.weight"]
    tensors = load_file(str(shard))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(tensors, str(shard))


@pytest.mark.parametrize(
    "break_it, message",
    [
        (_truncate_a_shard, r"is not a readable safetensors file"),
        (_drop_a_shard, r"model.safetensors.index.json names model-00001-of-\d+.safetensors, which is missing"),
        (_drop_every_shard, r"has a config.json but no \*.safetensors weights"),
        (_rename_a_tensor, r"tensor 'model.decoder.\S+' is not part of a Llama model"),
        (
            _shrink_a_tensor,
            r"'layers.1.feed_forward.w3.weight' has shape \(191, 64\) in the checkpoint but \(192, 64\)",
        ),
    ],
)
def test_corrupt_folder_is_one_line(hf, tmp_path, break_it, message):
    folder = _copy(hf[0], tmp_path / "hf")
    break_it(folder)
    with pytest.raises(CheckpointError, match=message) as e:
        _ours(folder)
    assert "\n" not in str(e.value)


def test_train_py_names_the_mismatched_field(hf, tmp_path):
    """End to end: the real debug flavor (dim 256) against the tiny folder, before any step."""
    result = run_python(
        "train.py",
        "--model.flavor",
        "debugmodel",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(hf[0]),
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "1",
        "--mixed_precision.enabled",
        "false",
    )
    assert result.returncode == 2, result.describe()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'hidden_size' = 64 but model.flavor 'debugmodel' has dim = 256" in errors[0], (
        result.describe()
    )


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    with pytest.raises(CheckpointError, match="not a size"):
        parse_size("lots")


# ---------------------------------------------------------------------------------------------
# Generation (tools/generate.py) against transformers' generate on the same weights: greedy, fp32,
# GEN_NEW new tokens, identical ids; from the HF folder, from the trained run's DCP step and from a
# model-only export of it; TP 2 (in dist_run's launch) equals one process, greedy and sampled.

GEN_PROMPT, GEN_NEW = "Hello, world", 32
SAMPLED = ("--temperature", "0.8", "--top-k", "50", "--top-p", "0.95", "--seed", "3")


def _generate_args(run: Path, tokenizer: Path, *extra: str) -> list[str]:
    """The trained run's step STEPS, continued GEN_NEW tokens in fp32 (rotary tables of 64: the
    run trained at 32)."""
    return [
        "--checkpoint.step",
        str(STEPS),
        "--job.dump_folder",
        str(run / "train"),
        "--model.flavor",
        "debugmodel",
        "--model.tokenizer",
        str(tokenizer),
        "--prompt",
        GEN_PROMPT,
        "--max-new-tokens",
        str(GEN_NEW),
        "--training.seq_len",
        "64",
        "--mixed_precision.enabled",
        "false",
        *extra,
    ]


def _generate(out: Path, *argv: str) -> list[int]:
    """tools/generate.py in this process: the new token ids of its one prompt."""
    from torchtitan_amp.tools.generate import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's steps: a second thread only slows them on a busy machine
    try:
        assert main([*argv, "--output", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    return record["tokens"]


def _transformers_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    # EOS named explicitly: the tiny folder's config.json keeps LlamaConfig's default ids.
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=GEN_NEW, do_sample=False, eos_token_id=257, pad_token_id=257
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def debug_flavor_is_the_tiny_one(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(
        llama.LLAMA3_FLAVORS, "debugmodel", dataclasses.replace(llama.LLAMA3_FLAVORS["debugmodel"], **FLAVOR)
    )


def test_generate_from_a_hugging_face_folder_gives_transformers_greedy_tokens(
    hf, tmp_path, debug_flavor_is_the_tiny_one
):
    ours = _generate(
        tmp_path / "out.jsonl",
        "--hf",
        str(hf[0]),
        "--model.flavor",
        "debugmodel",
        "--prompt",
        GEN_PROMPT,
        "--max-new-tokens",
        str(GEN_NEW),
        "--training.seq_len",
        "64",
        "--mixed_precision.enabled",
        "false",
    )
    theirs = _transformers_greedy(hf[1], build_tokenizer("byte").encode(GEN_PROMPT, bos=True, eos=False))
    assert len(theirs) == GEN_NEW and ours == theirs


@pytest.fixture(scope="module")
def one_process_generations(dist_run, tokenizer_folder, tmp_path_factory) -> dict[str, list[int]]:
    """The trained step generated on one process: greedy from the DCP step and from a model-only
    export of it, and sampled from the DCP step."""
    root = tmp_path_factory.mktemp("generate")
    export = _model_only_export(dist_run / "train" / "checkpoint" / f"step-{STEPS}", root / f"step-{STEPS}")
    step_args = _generate_args(dist_run, tokenizer_folder)
    export_args = [*step_args[2:], "--export", str(export)]  # the same without --checkpoint.step
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(
            llama.LLAMA3_FLAVORS, "debugmodel", dataclasses.replace(llama.LLAMA3_FLAVORS["debugmodel"], **FLAVOR)
        )
        return {
            "greedy": _generate(root / "greedy.jsonl", *step_args),
            "export": _generate(root / "export.jsonl", *export_args),
            "sampled": _generate(root / "sampled.jsonl", *step_args, *SAMPLED),
        }


def test_generate_from_a_checkpoint_and_an_export_gives_transformers_greedy_tokens(
    dist_run, tokenizer_folder, one_process_generations
):
    """Against transformers loading the run's own Hugging Face export of the same step."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(dist_run / "train" / "checkpoint" / f"hf-step-{STEPS}").eval()
    theirs = _transformers_greedy(model, build_tokenizer(str(tokenizer_folder)).encode(GEN_PROMPT, bos=True, eos=False))
    assert len(theirs) == GEN_NEW
    assert one_process_generations["greedy"] == theirs
    assert one_process_generations["export"] == theirs


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_generate_on_tp_2_equals_one_process(dist_run, one_process_generations, mode):
    (record,) = json.loads((dist_run / f"generate_tp_{mode}.json").read_text())
    assert record["prompt"] == GEN_PROMPT and record["stop"] == "length"
    assert record["tokens"] == one_process_generations[mode]
    assert one_process_generations["sampled"] != one_process_generations["greedy"]
