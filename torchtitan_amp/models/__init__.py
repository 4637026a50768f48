"""The model-family registry: `model.name` picks one of FAMILIES; the framework asks the chosen
`ModelFamily` (models/spec.py) for everything model-specific. Adding a family is its folder plus
one line here (or one register_family call, as the test-only families do)."""

from torchtitan_amp.models import deepseek_v3, gpt_oss, llama3, moe, qwen3
from torchtitan_amp.models.spec import ModelFamily, count_params

FAMILIES: dict[str, ModelFamily] = {
    "llama3": llama3.FAMILY,
    "moe": moe.FAMILY,
    "qwen3": qwen3.FAMILY,
    "deepseek_v3": deepseek_v3.FAMILY,
    "gpt_oss": gpt_oss.FAMILY,
}


def register_family(family: ModelFamily) -> None:
    """Add (or replace) a family for this process; model.name accepts its name from now on
    (rules.family_names reads FAMILIES once this package is imported)."""
    FAMILIES[family.name] = family


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; allowed families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


__all__ = ["FAMILIES", "ModelFamily", "count_params", "get_family", "register_family"]
