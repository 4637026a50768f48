"""FlexAttention as an attention backend (model.attention_backend): the decision and its one-line
refusals, and on CPU the flex forward (no grad: torch has no FlexAttention backward on CPU) equal
to SDPA with the dense mask for causal, documents, sliding windows and sinks, at kernel and model
level (validation's forward, generation). The flex-vs-SDPA training comparison on CUDA is in
tests/gpu/test_flex_attention_gpu.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.eval.generation import ModelRunner, generate
from torchtitan_amp.memory.specs import Layout
from torchtitan_amp.models import attention as attn
from torchtitan_amp.models.attention import FlexMasks, block_causal_mask, decide_backend, flex_attend
from torchtitan_amp.models.deepseek_v3.model import DEEPSEEK_V3_FLAVORS, DeepSeekV3Transformer
from torchtitan_amp.models.gpt_oss.model import GPT_OSS_FLAVORS, GptOssTransformer, SinkAttention
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS, Transformer
from torchtitan_amp.precision.plan import PrecisionPlan

U = 2.0**-24  # fp32 unit roundoff


def kernel_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """What two fp32 orders of summation of softmax(q k^T / sqrt(D)) v may differ by, per output.
    A score is a D-term dot product: its error is at most D u |q||k| / sqrt(D) (gamma_D), which
    exp turns into a relative error of each weight of at most that (and twice over through the
    normaliser); the normaliser and the weighted sum of v each add at most S u relative (gamma_S,
    S keys). An output is a convex combination of v's rows: |error| <= (2 D u s_max + 2 S u) max|v|,
    doubled as both kernels carry such an error."""
    d, s = q.shape[-1], k.shape[-2]
    s_max = (q.norm(dim=-1).max() * k.norm(dim=-1).max() / d**0.5).item()
    return 2 * (2 * d * U * s_max + 2 * s * U) * v.abs().max().item()


def _qkv(b: int = 2, h: int = 4, s: int = 64, d: int = 16, kv_heads: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    q = torch.randn(b, h, s, d)
    k, v = (torch.randn(b, kv_heads or h, s, d) for _ in range(2))
    return [q, k, v]


def _docs(b: int, s: int) -> torch.Tensor:
    """Three documents per row at different places (row 1 starts mid-document at id 0)."""
    ids = torch.zeros(b, s, dtype=torch.int32)
    ids[0, s // 4 :] += 1
    ids[0, s // 2 :] += 1
    ids[1, 5:] += 1
    ids[1, 40:] += 1
    return ids


def _dense(s: int, window: int | None, doc_ids: torch.Tensor | None) -> torch.Tensor:
    pos = torch.arange(s)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    if doc_ids is not None:
        return block_causal_mask(doc_ids) & allowed
    return allowed


@pytest.mark.parametrize(
    "case", ["causal", "block_causal", "sliding_window", "block_causal_window", "gqa_block_causal"]
)
def test_flex_forward_equals_sdpa_with_the_dense_mask(case: str) -> None:
    """Compiled flex_attention (CPU, no grad) vs SDPA given the same mask as a bool tensor."""
    q, k, v = _qkv(kv_heads=2 if case.startswith("gqa") else None)
    docs = _docs(2, 64) if "block_causal" in case else None
    window = 8 if "window" in case else None
    out = flex_attend(q, k, v, FlexMasks(docs, 2, q.device), window=window)
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=_dense(64, window, docs), enable_gqa=q.shape[1] != k.shape[1]
    )
    err, bound = (out - ref).abs().max().item(), kernel_bound(q, k, v)
    print(f"\n[flex vs sdpa] {case}: max |diff| {err:.2e}, bound {bound:.2e}")
    assert out.dtype == v.dtype and err <= bound


@pytest.mark.parametrize("window", [None, 8])
def test_sinks_by_the_fp32_lse_merge_equal_the_sink_column(window: int | None) -> None:
    """gpt-oss's sinks on flex (output x sigmoid(lse - sink), fp32) vs SinkAttention's explicit
    softmax over [scores, sink] in fp32, with documents: the same sums in other orders."""
    q, k, v = _qkv()
    docs = _docs(2, 64)
    core = SinkAttention(4, 16, window)
    with torch.no_grad():
        core.sinks.copy_(torch.tensor([-1.0, 0.0, 1.0, 3.0]))  # from negligible to dominant
        out = core(q, k, v, FlexMasks(docs, 2, q.device))
        ref = core(q, k, v, block_causal_mask(docs))
    err, bound = (out - ref).abs().max().item(), kernel_bound(q, k, v)
    print(f"\n[flex sinks] window {window}: max |diff| {err:.2e}, bound {bound:.2e}")
    assert err <= bound


def _llama() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64, vocab_size=64))
    model.init_weights()
    return model.eval()


# A model's logits pass L blocks of attention whose outputs differ by the kernel bound above;
# measured at most ~1e-6 on logits of magnitude ~1 (CPU, both models below); 1e-5 keeps ~10x.
MODEL_ATOL = 1e-5


def test_validation_forward_on_flex_equals_sdpa_with_documents() -> None:
    """Validation's forward (no grad, document masking) on the flex path: the loss and logits of
    the SDPA path with its [B, 1, S, S] mask."""
    model = _llama()
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    docs = _docs(2, 64)
    with torch.no_grad():
        ref = model(tokens, doc_ids=docs)
        model.attention_backend = "flex"
        out = model(tokens, doc_ids=docs)
    labels = tokens.roll(-1, dims=1)
    loss = [F.cross_entropy(x.flatten(0, 1), labels.flatten()).item() for x in (out, ref)]
    print(f"\n[flex model] max |logit diff| {(out - ref).abs().max():.2e}, losses {loss}")
    assert (out - ref).abs().max().item() <= MODEL_ATOL and abs(loss[0] - loss[1]) <= MODEL_ATOL


@pytest.mark.parametrize(
    "model_cls, flavors",
    [(GptOssTransformer, GPT_OSS_FLAVORS), (DeepSeekV3Transformer, DEEPSEEK_V3_FLAVORS)],
    ids=["gpt_oss", "deepseek_v3"],
)
def test_family_forward_on_flex_equals_sdpa(model_cls: type, flavors: dict) -> None:
    """With documents, flex's logits are SDPA's: gpt-oss (sinks, sliding and full layers: flex masks
    per window, shared) and DeepSeek-V3 (MLA: values narrower than queries and keys, the rotated key
    shared by every head)."""
    torch.manual_seed(0)
    model = model_cls(dataclasses.replace(flavors["debugmodel"], max_seq_len=64, vocab_size=64))
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    docs = _docs(2, 64)
    with torch.no_grad():
        ref = model(tokens, doc_ids=docs)
        model.attention_backend = "flex"
        out = model(tokens, doc_ids=docs)
    print(f"\n[flex {model_cls.__name__}] max |logit diff| {(out - ref).abs().max():.2e}")
    assert (out - ref).abs().max().item() <= MODEL_ATOL


def test_generation_on_flex_equals_sdpa() -> None:
    """Greedy KV-cache generation on the flex path (lower-right causal BlockMasks over the cache)
    gives the SDPA path's tokens."""
    model = _llama()
    prompt = [3, 17, 5, 9, 30, 2]
    _assert_cached_decode_on_flex_equals_sdpa(model, prompt, 8)


def test_gpt_oss_generation_on_flex_equals_sdpa() -> None:
    """gpt-oss's cached decode on flex (sinks by the fp32 merge, the sliding window as a
    lower-right BlockMask over the cache) gives the SDPA path's tokens, past the window."""
    torch.manual_seed(0)
    args = dataclasses.replace(GPT_OSS_FLAVORS["debugmodel"], max_seq_len=64, vocab_size=64)
    model = GptOssTransformer(args)
    model.init_weights()
    model.eval()
    prompt = [3, 17, 5, 9, 30, 2]
    _assert_cached_decode_on_flex_equals_sdpa(model, prompt, 2 * args.sliding_window)


def _assert_cached_decode_on_flex_equals_sdpa(model: torch.nn.Module, prompt: list[int], steps: int) -> None:
    """Greedy generation on flex and on SDPA: the same tokens, and every step's logits (prefill
    and each cached decode step) within MODEL_ATOL x their scale: greedy tokens alone survive a
    wrong sink or window on a small random model, the logits do not."""

    def run() -> tuple[list[int], list[torch.Tensor]]:
        logits: list[torch.Tensor] = []
        runner = ModelRunner(model, cast_output=lambda out: logits.append(out.detach().clone()) or out)
        return generate(runner, prompt, steps).tokens, logits

    model.attention_backend = "sdpa"
    tokens, reference = run()
    model.attention_backend = "flex"
    flex_tokens, flex = run()
    assert flex_tokens == tokens and len(flex) == len(reference) == steps
    scale = max(r.abs().max().item() for r in reference)
    for step, (got, want) in enumerate(zip(flex, reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=MODEL_ATOL * max(scale, 1.0), msg=f"step {step}")


@pytest.mark.parametrize(
    "device, mask, masks, cp, expected",
    [
        ("cuda", "block_causal", (), 1, "flex"),
        ("cuda", "causal", ("sliding window", "sinks"), 1, "flex"),
        ("cuda", "causal", (), 1, "sdpa"),
        ("cpu", "block_causal", ("sinks",), 1, "sdpa"),
        ("cuda", "block_causal", (), 2, "flex"),
        ("cuda", "causal", ("sliding window", "sinks"), 2, "flex"),
        ("cuda", "causal", (), 2, "sdpa"),
        ("cpu", "block_causal", (), 2, "sdpa"),
    ],
)
def test_auto_picks_flex_on_cuda_where_the_mask_is_not_plain_causal(
    device: str, mask: str, masks: tuple[str, ...], cp: int, expected: str
) -> None:
    decided = decide_backend("auto", device, mask, masks, cp)
    assert decided.backend == expected and decided.reason
    if cp > 1 and device == "cuda":  # the start-up line says which path context parallel takes
        assert f"context parallel {cp}" in decided.describe()


@pytest.mark.parametrize(
    "device, cp, training, missing, message",
    [
        ("cpu", 1, True, None, "cannot train on cpu: torch .* has no FlexAttention backward"),
        ("cpu", 2, True, None, "cannot train on cpu: torch .* has no FlexAttention backward"),
        ("cuda", 1, True, "torch 2.x has no FlexAttention (x)", "torch 2.x has no FlexAttention"),
    ],
)
def test_flex_refusals_are_one_line(
    monkeypatch: pytest.MonkeyPatch, device: str, cp: int, training: bool, missing: str | None, message: str
) -> None:
    monkeypatch.setattr(attn, "flex_missing", lambda: missing)
    with pytest.raises(ConfigError, match=message) as err:
        decide_backend("flex", device, "block_causal", (), cp, training)
    assert "\n" not in str(err.value)


def test_flex_on_cpu_for_evaluation_is_allowed() -> None:
    assert decide_backend("flex", "cpu", "causal", (), 1, training=False).backend == "flex"
    assert decide_backend("flex", "cpu", "causal", (), 2, training=False).backend == "flex"
    assert decide_backend("flex", "cuda", "block_causal", (), 2).backend == "flex"


def test_the_plan_decides_and_reports_the_backend() -> None:
    """The precision plan holds the decision; flex for CPU training is refused at config time."""
    dims = ParallelDims(1, 1, 1, 1, 1)
    config = load_config(["--model.attn_mask_type", "block_causal"])
    cuda = PrecisionPlan.from_config(config, dims, "cuda", probe=None)
    assert cuda.attention_backend == "flex" and "block_causal" in cuda.attention_reason
    assert PrecisionPlan.from_config(config, dims, "cpu", probe=None).attention_backend == "sdpa"
    with pytest.raises(ConfigError, match="attention_backend' = 'flex' cannot train on cpu"):
        PrecisionPlan.from_config(load_config(["--model.attention_backend", "flex"]), dims, "cpu", probe=None)


def test_no_dense_mask_term_under_flex() -> None:
    """The memory model's [S, S] bool mask is SDPA's; flex's BlockMask has none."""
    assert Layout(attn_mask_type="block_causal").masked
    assert not Layout(attn_mask_type="block_causal", attention_backend="flex").masked


def test_op_sac_saves_the_flex_op() -> None:
    """Op-level SAC keeps FlexAttention's output (torch.ops.higher_order.flex_attention, the op a
    compiled block's checkpoint region sees) as it keeps SDPA's: backward does not rerun it."""
    from torch.utils.checkpoint import CheckpointPolicy

    from torchtitan_amp.distributed.activation_checkpoint import _op_sac_policy

    ctx = type("Ctx", (), {"is_recompute": False})()
    policy = _op_sac_policy("alternate")
    assert policy(ctx, torch.ops.higher_order.flex_attention) == CheckpointPolicy.MUST_SAVE
    assert policy(ctx, torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def _family(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls, flavors = {
        "llama3": (Transformer, LLAMA3_FLAVORS),
        "deepseek_v3": (DeepSeekV3Transformer, DEEPSEEK_V3_FLAVORS),
        "gpt_oss": (GptOssTransformer, GPT_OSS_FLAVORS),
    }[name]
    model = cls(dataclasses.replace(flavors["debugmodel"], max_seq_len=64, vocab_size=64))
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_audit_records_the_attention_op_each_layer_ran(family: str, backend: str) -> None:
    """The precision audit's recorder names the attention op each layer ran (a forward with
    documents, no grad: CPU), and the start-up report's per-layer line says the same op."""
    from types import SimpleNamespace

    from torchtitan_amp.precision.audit import _module_stack, _Recorder
    from torchtitan_amp.precision.report import attention_summary

    model = _family(family)
    model.attention_backend = backend
    recorder = _Recorder(set())
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), _module_stack([model], recorder), recorder:
        model(tokens, doc_ids=_docs(2, 64))
    ran = {}
    for module, ops in recorder.seen.items():
        for op in ops.get("attention op", ()):
            ran[module.removesuffix(".core")] = op
    reported = attention_summary(SimpleNamespace(attention_backend=backend, attention_reason=""), model)["layers"]
    layers = [f"layers.{i}.attention" for i in range(len(model.layers))]
    assert sorted(reported) == layers
    for layer in layers:
        if family == "gpt_oss" and backend == "sdpa":  # the sink column: matmuls, no SDPA kernel
            assert layer not in ran and reported[layer].startswith("matmul + softmax in fp32")
        else:
            expected = {"sdpa": "scaled_dot_product_attention", "flex": "flex_attention"}[backend]
            assert ran[layer] == expected and reported[layer].startswith(expected)


def test_micro_batches_with_one_layout_share_one_block_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards whose document ids are equal (micro-batches of one step with one layout: other
    tensors, same content) build each BlockMask once; other documents build anew. Without
    documents (gpt-oss's windows and sinks on causal) the masks depend on the shapes alone."""
    import torch.nn.attention.flex_attention as fa

    built = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    attn.clear_shared_masks()
    model = _family("llama3")
    model.attention_backend = "flex"
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for docs in (_docs(2, 64), _docs(2, 64), _docs(2, 64).roll(3, dims=1)):
            model(tokens, doc_ids=docs)
    assert len(built) == 2
    built.clear()
    model = _family("gpt_oss")
    model.attention_backend = "flex"
    with torch.no_grad():
        for _ in range(3):
            model(tokens)
    assert len(built) == 2  # the sliding window's and the full layers'


def _count_block_masks(monkeypatch: pytest.MonkeyPatch, build: bool = True) -> list[int]:
    """Counts create_block_mask calls (building the real BlockMask, or standing in for it)."""
    import torch.nn.attention.flex_attention as fa

    built: list[int] = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or (real(*a, **k) if build else None))
    attn.clear_shared_masks()
    return built


def _packed(layout: list[int], vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """[2, 64] host tokens, random in [3, vocab), with a BOS (id 1) at each position of `layout`."""
    tokens = torch.randint(3, vocab, (2, 64), generator=torch.Generator().manual_seed(seed))
    tokens[:, layout] = 1
    return tokens


def test_device_micro_batches_with_one_layout_share_one_block_mask_by_host_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a device, each micro-batch's document ids are a new tensor whose values the host cannot
    read without a sync: the trainer's path (data.loader.to_device, then MaskInputs) computes them
    from the host batch as well, and the cache compares those. The meta device stands in for the
    GPU (its values cannot be read at all): micro-batches with other tokens in one layout build one
    BlockMask, another layout a second, the first layout again none."""
    from torchtitan_amp.data.loader import to_device

    built = _count_block_masks(monkeypatch, build=False)
    mask_inputs = attn.MaskInputs("block_causal", bos_id=1, eos_id=2, host_ids=True)
    meta = torch.device("meta")
    for seed, layout in enumerate([[0, 20], [0, 20], [0, 20], [0, 33], [0, 20]]):
        docs = mask_inputs(to_device(_packed(layout, seed=seed), meta))["doc_ids"]
        assert docs.device == meta
        FlexMasks(docs, 2, meta).block_mask(None, 64, 64)
    assert len(built) == 2


def test_alternating_layouts_each_build_once_and_give_sdpa_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation's batches repeat every run: layouts A, B, A, B build two BlockMasks (one per
    layout, never one for both), and each forward's logits are SDPA's with that batch's mask."""
    built = _count_block_masks(monkeypatch)
    model = _llama()
    mask_inputs = attn.MaskInputs("block_causal", bos_id=1, eos_id=2, host_ids=True)
    with torch.no_grad():
        for seed, layout in enumerate([[0, 20], [0, 33, 50], [0, 20], [0, 33, 50]]):
            tokens = _packed(layout, seed=seed)
            docs = mask_inputs(tokens)["doc_ids"]
            model.attention_backend = "sdpa"
            ref = model(tokens, doc_ids=docs)
            model.attention_backend = "flex"
            out = model(tokens, doc_ids=mask_inputs(tokens.clone())["doc_ids"])
            assert (out - ref).abs().max().item() <= MODEL_ATOL
    assert len(built) == 2


# Graphs of a model's compiled blocks: one per kind of block, the same code with other constants
# (gpt-oss: sliding and full layers; DeepSeek-V3: the dense first layer and the MoE ones).
BLOCK_KINDS = {"llama3": 1, "gpt_oss": 2, "deepseek_v3": 2}


@pytest.mark.parametrize("family", ["llama3", "gpt_oss", "deepseek_v3"])
def test_compiled_blocks_on_flex_equal_eager_sdpa(family: str) -> None:
    """apply_compile's blocks (fullgraph, aot_eager: dynamo and AOT autograd as inductor sees them)
    on flex, with documents (gpt-oss: sinks and sliding windows too), no grad (CPU): dynamo traces
    flex_attention as its higher-order op over the BlockMasks the model's forward built before the
    blocks (compile.enable's default GPU recipe: attention_backend auto is flex there), one graph per
    kind of block and no graph break, and the logits are eager SDPA's within MODEL_ATOL. A second
    layout reuses the graphs (no recompile) and gives its own SDPA logits."""
    from torch._dynamo.utils import counters

    from torchtitan_amp.distributed.compile import apply_compile

    model = _family(family)
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    layouts = [_docs(2, 64), _docs(2, 64).roll(3, dims=1)]
    with torch.no_grad():
        refs = [model(tokens, doc_ids=docs) for docs in layouts]
        torch._dynamo.reset()
        counters.clear()
        attn.clear_shared_masks()
        model.attention_backend = "flex"
        apply_compile(model, fullgraph=True, backend="aot_eager")
        outs = [model(tokens, doc_ids=docs) for docs in layouts]
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    errs = [(out - ref).abs().max().item() for out, ref in zip(outs, refs)]
    print(f"\n[compiled flex {family}] graphs {graphs}, breaks {breaks}, max |logit diff| {errs}")
    assert (graphs, breaks) == (BLOCK_KINDS[family], 0), dict(counters["graph_break"])
    assert max(errs) <= MODEL_ATOL


@pytest.mark.parametrize("mode", ["op", "full"])
def test_compiled_ac_blocks_on_flex_keep_or_rerun_the_flex_op(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Activation checkpointing around compiled blocks on flex (apply_ac, then apply_compile), with
    grad: op-level SAC keeps FlexAttention's output (SAC_SAVE_LIST's higher-order op), so the
    compiled backward holds flex_attention_backward alone; full AC reruns flex_attention there.
    Gradients are eager SDPA's. CPU has no FlexAttention backward by torch's check in the
    flex_attention wrapper alone (_validate_device); the op's dense implementation, which
    aot_eager runs, has one: the test steps past the check to see the graphs CUDA's would be."""
    import torch.nn.attention.flex_attention as fa
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from torchtitan_amp.config import ActivationCheckpointConfig
    from torchtitan_amp.distributed.activation_checkpoint import apply_ac
    from torchtitan_amp.distributed.compile import apply_compile

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2, max_seq_len=64, vocab_size=64))
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    model(tokens, doc_ids=_docs(2, 64)).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    graphs: dict[str, list[set[str]]] = {"forward": [], "backward": []}

    def recorded(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
            graphs[kind].append({str(n.target) for n in gm.graph.nodes if "flex" in str(n.target)})
            return make_boxed_func(gm.forward)

        return compiler

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    torch._dynamo.reset()
    attn.clear_shared_masks()
    model.attention_backend = "flex"
    ac = ActivationCheckpointConfig(mode="selective", selective_ac_option="op") if mode == "op" else None
    apply_ac(model, ac or ActivationCheckpointConfig(mode="full"), ())
    backend = aot_autograd(fw_compiler=recorded("forward"), bw_compiler=recorded("backward"))
    apply_compile(model, fullgraph=True, backend=backend)
    model(tokens, doc_ids=_docs(2, 64)).square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    errs = [((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref)]
    print(f"\n[compiled {mode} AC flex] graphs {graphs}, max relative |grad diff| {max(errs):.1e}")
    assert graphs["forward"] == [{"flex_attention"}]
    rerun = {"flex_attention"} if mode == "full" else set()
    assert graphs["backward"] == [{"flex_attention_backward"} | rerun]
    # The same fp32 ops in other orders (flex's dense backward vs SDPA's): measured 3e-7 of each
    # gradient's largest element; 1e-5 as the family block-compile tests' rtol.
    assert len(grads) == len(ref) and max(errs) <= 1e-5
