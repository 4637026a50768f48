"""Model families: model.name picks a registered family, model.flavor is checked
against that family's flavors, --help lists both, and a test-only family (tests/families/
tiny_gelu: Llama blocks with a GELU MLP) plugs in with one registration. In-process checks; the
launched ones (train, resume, dry run, Hugging Face round trip) are in test_families_dist.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.families import tiny_gelu
from tests.support.launch import run_python
from torchtitan_amp import models
from torchtitan_amp.config import ConfigError, help_text, load_config
from torchtitan_amp.core import rules
from torchtitan_amp.models import FAMILIES, get_family
from torchtitan_amp.models.spec import count_params

pytestmark = pytest.mark.unit


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """tiny_gelu registered for this test only."""
    monkeypatch.setitem(FAMILIES, "tiny_gelu", tiny_gelu.FAMILY)
    return tiny_gelu.FAMILY


def test_llama3_is_the_built_in_family() -> None:
    family = get_family("llama3")
    assert set(rules.FAMILIES["llama3"]) <= set(family.flavors)
    with pytest.raises(ValueError, match=r"unknown model family 'gpt'; allowed families: llama3"):
        get_family("gpt")


def test_the_torch_free_table_names_every_built_in_familys_flavors_in_order() -> None:
    """core.rules.FAMILIES (what config parsing and --help read before torch is imported) is each
    built-in family's flavor registry, name for name and in order."""
    assert list(rules.FAMILIES) == list(FAMILIES)
    for name, family in FAMILIES.items():
        assert rules.FAMILIES[name] == tuple(family.flavors), name


def test_no_two_families_share_a_flavor_name() -> None:
    """A flavor name says which model it is: none is two families' (a GQA approximation under the
    moe family named like DeepSeek-V3's MLA flavor would be read as it), but for `debugmodel`, each
    family's debug shape (torchtitan's name), whose family model.name says."""
    owners: dict[str, list[str]] = {}
    for name, family in FAMILIES.items():
        for flavor in family.flavors:
            owners.setdefault(flavor, []).append(name)
    assert {f: o for f, o in owners.items() if len(o) > 1 and f != "debugmodel"} == {}


def test_takes_labels_is_the_familys(registered) -> None:  # type: ignore[no-untyped-def]
    """The trainer passes the labels to the forwards of the flavors whose family says so
    (ModelFamily.takes_labels): DeepSeek-V3's with multi-token prediction depths; every other
    family, a registered one included, has the default (no)."""
    takers = {
        (n, f) for n, family in FAMILIES.items() for f, args in family.flavors.items() if family.takes_labels(args)
    }
    assert takers == {("deepseek_v3", "deepseek_v3_671b"), ("deepseek_v3", "debugmodel_mtp")}


def test_model_name_is_checked_against_the_registry(registered) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as e:
        load_config(["--model.name", "gpt"])
    names = ", ".join(repr(name) for name in FAMILIES)  # the built-in families, then tiny_gelu
    assert str(e.value) == f"'model.name' = 'gpt' is not allowed; choose one of: {names}"
    config = load_config(["--model.name", "tiny_gelu", "--model.flavor", "tiny"])
    assert (config.model.name, config.model.flavor) == ("tiny_gelu", "tiny")


def test_flavor_must_belong_to_the_chosen_family(registered) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as e:
        load_config(["--model.name", "tiny_gelu", "--model.flavor", "debugmodel"])
    assert str(e.value) == (
        "'model.flavor' = 'debugmodel' is not a flavor of model.name = 'tiny_gelu'; choose one of: 'tiny', 'tiny_3l'"
    )
    with pytest.raises(ConfigError, match="is not a flavor of model.name = 'llama3'"):
        load_config(["--model.flavor", "tiny"])


def test_help_lists_families_and_flavors(registered) -> None:  # type: ignore[no-untyped-def]
    lines = help_text().splitlines()
    name = next(line for line in lines if line.strip().startswith("--model.name "))
    flavor = next(line for line in lines if line.strip().startswith("--model.flavor "))
    assert "{" + ", ".join(FAMILIES) + "}" in name and name.endswith(", tiny_gelu}")
    assert (
        "{debugmodel, debugmodel_h64, debugmodel_tiny, llama3_8b, llama3_70b, llama3_405b, llama3_2_1b, "
        "llama3_2_3b, llama3_0_8b, llama3_0_70b, debugmodel_moe, "
        "debugmodel_moe_sigmoid, debugmodel_moe_aux, debugmodel_qwen3, qwen3_30b_a3b, moe_16b_gqa, "
    ) in flavor
    # every family's flavors, each name once, in registry order (tiny_gelu's last)
    every = dict.fromkeys(f for family in FAMILIES.values() for f in family.flavors)
    assert "{" + ", ".join(every) + "}" in flavor and flavor.endswith("tiny, tiny_3l}")


def test_family_names_are_torch_free_before_models_is_imported() -> None:
    code = (
        "import sys; from torchtitan_amp.config import load_config, ConfigError\n"
        "try: load_config(['--model.name', 'gpt'])\nexcept ConfigError as e: print(e)\n"
        "print('torch' in sys.modules)"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.describe()
    names = ", ".join(repr(name) for name in rules.FAMILIES)  # the torch-free table's
    assert result.stdout.splitlines() == [f"'model.name' = 'gpt' is not allowed; choose one of: {names}", "False"]


def test_tiny_gelu_builds_through_the_spec(registered) -> None:  # type: ignore[no-untyped-def]
    family = get_family("tiny_gelu")
    args = family.build_args("tiny", 258, 32)
    with torch.device("meta"):
        model = family.build_model(args)
    ffn = model.layers["0"].feed_forward
    assert {n for n, _ in ffn.named_parameters()} == {"w_in.weight", "w_out.weight"}
    # The memory model's parameter specs name and size exactly the model's parameters.
    dims = family.memory_dims(args)
    assert dims.total_params() == count_params(model)
    from torchtitan_amp.memory import Stage

    specs = {s.name: s.shape for s in dims.param_specs(Stage(0, range(args.n_layers), True, True))}
    assert specs == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_a_family_without_per_step_hooks_gets_no_ops(registered) -> None:  # type: ignore[no-untyped-def]
    """The trainer runs a family's hooks every step, unconditionally: a family that declares none
    (tiny_gelu) gets callables that do nothing and report no metrics."""
    family = get_family("tiny_gelu")
    with torch.device("meta"):
        parts = [family.build_model(family.build_args("tiny", 258, 32))]
    assert family.after_backward(parts, None, None, cross_group=None) == {}
    assert family.after_step(parts) is None and family.set_loss_factor(parts, 0.5) is None


def test_hf_names_round_trip(registered) -> None:  # type: ignore[no-untyped-def]
    hf = get_family("tiny_gelu").hf
    args = get_family("tiny_gelu").build_args("tiny", 258, 32)
    with torch.device("meta"):
        names = list(get_family("tiny_gelu").build_model(args).state_dict())
    assert all(hf.from_hf_name(hf.to_hf_name(n)) == n for n in names)
    assert hf.to_hf_name("layers.1.feed_forward.w_in.weight") == "model.layers.1.mlp.up_proj.weight"
    assert hf.hf_config(args, "float32", None, None)["hidden_act"] == "gelu"
    assert (
        models.get_family("llama3").hf.hf_config(
            get_family("llama3").build_args("debugmodel", 258, 32), "float32", None, None
        )["hidden_act"]
        == "silu"
    )


def test_hf_adapters_implement_the_named_interface(registered) -> None:  # type: ignore[no-untyped-def]
    """HFAdapter is an abstract class of named, typed methods; each family's adapter is a class
    implementing it (tiny_gelu's derives from Llama's), and one that leaves a method out cannot be
    made."""
    import inspect
    import typing

    from torchtitan_amp.models.llama3.hf import LlamaHFAdapter
    from torchtitan_amp.models.spec import HFAdapter

    assert inspect.isabstract(HFAdapter)
    methods = (
        "to_hf_name",
        "from_hf_name",
        "rotary_heads",
        "config_fields",
        "args_fields",
        "hf_config",
        "describe",
        "stacked",
    )
    for name in methods:
        assert "return" in typing.get_type_hints(getattr(HFAdapter, name)), name
    for family in ("llama3", "moe", "tiny_gelu"):
        hf = get_family(family).hf
        assert isinstance(hf, HFAdapter) and all(inspect.ismethod(getattr(hf, m)) for m in methods)
    assert isinstance(get_family("tiny_gelu").hf, LlamaHFAdapter)

    class NoConfig(HFAdapter):
        display_name = "partial"

        def to_hf_name(self, fqn: str) -> str:
            return fqn

    with pytest.raises(TypeError, match="abstract"):
        NoConfig()  # type: ignore[abstract]


def test_adding_a_family_touches_its_folder_and_one_line() -> None:
    """tiny_gelu lives in its folder; the framework names no family but in models/__init__.py's
    registry (and Llama's own folder)."""
    root = Path(__file__).resolve().parents[1] / "torchtitan_amp"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "tiny_gelu" in p.read_text()]
    assert offenders == []


def test_tp_traffic_counts_the_familys_tp_regions() -> None:
    """The shared TP accounting asks the family's dims which TP regions a block has. Per "split"
    region (colwise -> rowwise): sequence parallel sends an entry all-gather and an exit
    reduce-scatter each way (4), without it one all-reduce each way (2). A "replicated" one (an
    MoE layer) all-gathers its input and its output's gradient under SP (2), nothing without; a
    "replicated_split" one (with a shared expert) adds an all-reduce each way (4 / 2). A recomputed
    block repeats its forward collectives but the block's last if it is an exit. All of them are
    [T, d] tensors in bf16 here."""
    from dataclasses import dataclass

    from torchtitan_amp import memory

    def family(regions: tuple[str, ...]) -> type:
        @dataclass(frozen=True)
        class Dims(memory.ModelDims):
            def tp_regions(self, layer: int) -> tuple[str, ...]:
                return regions

        return Dims

    prec = memory.PrecisionSpec.simple("fsdp")

    def per_block(cls: type, layout: memory.Layout) -> float:
        def total(n_layers: int) -> int:
            dims = cls(64, n_layers, 4, 2, 128, 256)
            norm_grads = sum(memory.tp_partial_grad_comm(dims, prec, layout).values())
            return sum(sum(v.values()) for v in memory.tp_comm(dims, prec, layout).values()) - norm_grads

        return (total(4) - total(2)) / 2

    # regions: {sequence parallel: (collectives per block, again when recomputed)}
    cases = {
        ("split", "split"): {True: (8, 3), False: (4, 1)},  # Llama's
        ("split",) * 3: {True: (12, 5), False: (6, 2)},
        ("split", "replicated"): {True: (6, 3), False: (2, 1)},
        ("split", "replicated_split"): {True: (8, 3), False: (4, 1)},
    }
    assert memory.ModelDims(64, 4, 4, 2, 128, 256).tp_regions(0) == ("split", "split")
    for regions, counts in cases.items():
        for sp, (once, again) in counts.items():
            for ac, recompute in (("none", 0), ("full", 1)):
                layout = memory.Layout(tp=2, seq_len=16, sequence_parallel=sp, ac_mode=ac)
                tensor = layout.microbatch_tokens * 64 * 2
                assert per_block(family(regions), layout) == (once + recompute * again) * tensor, (regions, sp, ac)


def test_moe_dims_name_a_replicated_tp_region_per_moe_layer() -> None:
    """MoE blocks: attention split, the MoE layer replicated (models/moe/parallelize.py), with the
    shared expert's all-reduces when it has one; dense blocks are Llama's."""
    from torchtitan_amp.memory.moe import MoEDims

    dims = MoEDims(64, 4, 4, 2, 128, 256, n_dense_layers=1, n_shared_experts=1)
    assert [dims.tp_regions(i) for i in (0, 1)] == [("split", "split"), ("split", "replicated_split")]
    assert MoEDims(64, 4, 4, 2, 128, 256).tp_regions(0) == ("split", "replicated")
