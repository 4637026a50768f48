"""Text generation from a model as trained: prefill the prompt in one forward, then decode token
by token with a KV cache on every attention layer (models/kv_cache.py), choosing each token
greedily or by sampling (temperature, top-k, top-p, a seeded torch.Generator) until EOS or
max_new_tokens.

- Precision: every forward runs in the forward context the run's precision plan gives (bf16
  autocast where it trained with autocast, FSDP's param dtype on the FSDP path, fp32 where the
  plan chose fp32) and its output cast; tokens are chosen from fp32 logits.
- Prompts run one at a time (batch 1): no padding or masking between prompts of different
  lengths, and each prompt's tokens are those it would get alone.
- Parallelism: every rank runs the same loop (FSDP and TP forwards are collective), and rank 0's
  choice of each token is broadcast, so the ranks feed the same tokens and stop together. Under
  TP with sequence parallel a step's tokens are padded at the end to a multiple of the TP degree
  (causal attention keeps the padding out of the real tokens' outputs; the cache forgets it).
  Pipeline and context parallel are refused (`resolve_samples`; tools/generate.py runs TP only).
- torch.compile'd blocks run eagerly here (`torch.compiler.set_stance("force_eager")`): the cache's
  growing shapes would recompile them at every step.

`validation.sample_prompts` (`resolve_samples`, validation.Validator) generates at every
evaluation; tools/generate.py is the command line. See docs/generation.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.models.kv_cache import KVCache
from torchtitan_amp.precision import autocast

if TYPE_CHECKING:
    from torchtitan_amp.config import JobConfig
    from torchtitan_amp.data.tokenizer import Tokenizer
    from torchtitan_amp.precision import PrecisionPlan


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0: greedy (argmax; top_k and top_p do not
    matter). Otherwise softmax(logits / temperature) restricted to the top_k most likely tokens
    (0: all) and then to the smallest set whose probability reaches top_p (1: all), drawn with a
    torch.Generator seeded with `seed`: the same seed gives the same text."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Named as the command line spells them; validation.sample_temperature is checked at parse time.
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: no top-k), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] (1: no top-p), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 logits [B, V] -> temperature-scaled logits with the tokens top-k and top-p exclude
    set to -inf (the order and rules of transformers' TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper; tested against them)."""
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ascending, order = logits.sort(dim=-1)
        # Drop the unlikely tail whose mass is at most 1 - top_p; the likeliest token always stays.
        tail = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        tail[..., -1] = False
        logits = logits.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The chosen token ids [B] from fp32 logits [B, V].

    Args:
        logits: the fp32 logits [B, V] after the last position.
        sampling: how the token is chosen (greedy, or drawn after temperature, top_k and top_p).
        generator: the generator the draw uses (seeded by the sampling's seed); None when greedy.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Running the model


@dataclass(frozen=True)
class ModelRunner:
    """A model as generation runs it: inside the precision plan's forward context, its output
    cast by the plan, each step's tokens padded to a multiple of `multiple`."""

    model: nn.Module
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    cast_output: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
    multiple: int = 1

    @classmethod
    def for_plan(cls, model: nn.Module, plan: PrecisionPlan, tp: int, sequence_parallel: bool) -> ModelRunner:
        """A runner for `model` under the precision plan: its forward context and output cast, each step
        padded as sequence parallel needs.

        Args:
            model: the model (this rank's part under tensor parallel).
            plan: the precision plan, whose forward context and output cast generation runs under.
            tp: the tensor-parallel degree.
            sequence_parallel: whether sequence parallel is on (then a step's token count must divide by tp).
        """
        return cls(
            model,
            functools.partial(autocast.forward_context, plan),
            functools.partial(autocast.cast_output, plan),
            sequence_multiple(tp, sequence_parallel),
        )

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model's rotary tables cover (training.seq_len)."""
        args: Any = self.model.model_args
        return args.max_seq_len


def sequence_multiple(tp: int, sequence_parallel: bool) -> int:
    """What a step's token count must divide by: sequence parallel splits every sequence over
    the TP ranks."""
    return tp if tp > 1 and sequence_parallel else 1


@contextlib.contextmanager
def kv_caches(model: nn.Module, max_len: int) -> Iterator[list[KVCache]]:
    """A fresh KV cache of max_len positions on every module declaring a `kv_cache` slot (each
    attention), removed on exit."""
    layers: list[Any] = [m for m in model.modules() if hasattr(type(m), "kv_cache")]  # each an attention
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention with a kv_cache slot")
    caches = [KVCache(max_len) for _ in layers]
    for layer, cache in zip(layers, caches):
        layer.kv_cache = cache
    try:
        yield caches
    finally:
        for layer in layers:
            del layer.kv_cache  # back to the class's None


def step_logits(runner: ModelRunner, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
    """One forward of `tokens` [B, S], continuing what `caches` hold -> the fp32 logits [B, V]
    after the last of them.

    Args:
        runner: the model as generation runs it (context, output cast, padding multiple).
        tokens: the new token ids [B, S].
        caches: every attention's KV cache (kv_caches), holding the positions before `tokens`.
    """
    seq = tokens.shape[1]
    pad = -seq % runner.multiple
    if pad:
        tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad)], dim=1)
    with runner.forward_context():
        logits = runner.cast_output(runner.model(tokens))
    if isinstance(logits, DTensor):  # TP's loss-parallel output is sharded over the vocabulary
        logits = logits.full_tensor()
    for cache in caches:
        cache.rewind(pad)
    return logits[:, seq - 1].float()


def positions_needed(prompt_len: int, max_new_tokens: int, multiple: int = 1) -> int:
    """Rotary positions (and cache entries) a generation may use: the prompt, the continuation,
    and the padding of the last step.

    Args:
        prompt_len: the prompt's length in tokens.
        max_new_tokens: the most tokens generated.
        multiple: what each step's token count is padded to a multiple of (sequence_multiple).
    """
    return prompt_len + max_new_tokens + multiple - 1


def first_too_long(
    prompts: Iterable[Sequence[int]], max_new_tokens: int, max_seq_len: int, multiple: int = 1
) -> tuple[int, int, int] | None:
    """(index, length, positions needed) of the first prompt that cannot be continued by
    max_new_tokens within max_seq_len positions, or None: the callers name their own fields.

    Args:
        prompts: the prompts, as token ids.
        max_new_tokens: the most tokens generated for each.
        max_seq_len: the positions the model's rotary tables cover.
        multiple: what each step's token count is padded to a multiple of (sequence_multiple).
    """
    for i, prompt in enumerate(prompts):
        needed = positions_needed(len(prompt), max_new_tokens, multiple)
        if needed > max_seq_len:
            return i, len(prompt), needed
    return None


def _agree(token: torch.Tensor) -> torch.Tensor:
    """Rank 0's token on every rank: the ranks must feed the same tokens to their collective
    forwards, and stop after the same step."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(token, src=0)
    return token


@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # the new tokens, the EOS that ended them included
    stop: str  # "eos" or "length" (max_new_tokens reached)


@torch.no_grad()
def generate(
    runner: ModelRunner,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
) -> Completion:
    """Continue `prompt` (token ids) by up to max_new_tokens tokens. Every rank holding part of
    the model must call it with the same arguments. The model should be in eval mode. Raises
    ValueError for an empty prompt or one that leaves no room within the model's max_seq_len.

    Args:
        runner: the model as generation runs it (context, output cast, padding multiple).
        prompt: the prompt's token ids (not empty).
        max_new_tokens: the most tokens generated (>= 1).
        sampling: how each token is chosen (greedy by default).
        eos_id: the token that ends the continuation early (it is kept in the completion); None:
            always run max_new_tokens.
    """
    needed = positions_needed(len(prompt), max_new_tokens, runner.multiple)
    if not prompt or max_new_tokens < 1 or needed > runner.max_seq_len:
        raise ValueError(
            f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones need {needed} "
            f"positions; the model has 1..{runner.max_seq_len}"
        )
    device = next(runner.model.parameters()).device
    generator = None if sampling.greedy else torch.Generator(device).manual_seed(sampling.seed)
    tokens: list[int] = []
    with torch.compiler.set_stance("force_eager"), kv_caches(runner.model, needed) as caches:
        step = torch.tensor([prompt], device=device)
        while True:
            token = _agree(next_token(step_logits(runner, step, caches), sampling, generator))
            tokens.append(int(token))
            if tokens[-1] == eos_id or len(tokens) == max_new_tokens:
                return Completion(tokens, "eos" if tokens[-1] == eos_id else "length")
            step = token[:, None]


def record(prompt: str, completion: Completion, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a generation reports (the tool's --output lines, samples.jsonl): the prompt, the
    continuation's text (without EOS), its token ids and why it stopped.

    Args:
        prompt: the prompt's text.
        completion: the continuation `generate` returned.
        tokenizer: the tokenizer decoding it.
    """
    text_ids = completion.tokens[:-1] if completion.stop == "eos" else completion.tokens
    return {"prompt": prompt, "text": tokenizer.decode(text_ids), "tokens": completion.tokens, "stop": completion.stop}


# ---------------------------------------------------------------------------------------------
# validation.sample_prompts


@dataclass(frozen=True)
class SamplePrompts:
    """validation.sample_prompts resolved at config time: the prompts with their token ids (BOS
    first), the continuation length, the sampling and the tokenizer that decodes them."""

    prompts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    sampling: Sampling
    tokenizer: Any  # tokenizer.Tokenizer

    def generate(self, runner: ModelRunner) -> list[dict[str, Any]]:
        """Every prompt's record (`record`); a collective call, as `generate`."""
        return [
            record(
                text,
                generate(runner, list(ids), self.max_new_tokens, self.sampling, self.tokenizer.eos_id),
                self.tokenizer,
            )
            for text, ids in zip(self.prompts, self.ids)
        ]


def resolve_samples(config: JobConfig, tokenizer: Tokenizer | None, max_seq_len: int) -> SamplePrompts | None:
    """The sample prompts generated at each validation, encoded; None without
    validation.sample_prompts (or without a tokenizer: a dry run generates nothing).
    Refuses (ConfigError) the layouts generation does not run on and prompts too long for the model.

    Args:
        config: the job config (validation.sample_prompts and their sampling, the parallel layout).
        tokenizer: the run's tokenizer, encoding the prompts; None: a dry run.
        max_seq_len: the positions the model's rotary tables cover.
    """
    v, p = config.validation, config.parallelism
    if not v.sample_prompts:
        return None
    for name in ("pipeline_parallel_degree", "context_parallel_degree"):
        if getattr(p, name) > 1:
            raise ConfigError(
                f"'validation.sample_prompts' is not supported with parallelism.{name} = "
                f"{getattr(p, name)} (generation runs whole sequences through the whole model "
                "on every rank); leave sample_prompts empty"
            )
    if tokenizer is None:
        return None
    multiple = sequence_multiple(p.tensor_parallel_degree, p.enable_sequence_parallel)
    ids = tuple(tuple(tokenizer.encode(text, bos=True, eos=False)) for text in v.sample_prompts)
    too_long = first_too_long(ids, v.sample_max_new_tokens, max_seq_len, multiple)
    if too_long is not None:
        i, length, needed = too_long
        padding = f" + {multiple - 1} of sequence-parallel padding" if multiple > 1 else ""
        raise ConfigError(
            f"'validation.sample_prompts' entry {i} has {length} tokens: with validation."
            f"sample_max_new_tokens = {v.sample_max_new_tokens}{padding} it needs {needed} positions, "
            f"more than training.seq_len = {max_seq_len}; shorten it or generate fewer tokens"
        )
    sampling = Sampling(temperature=v.sample_temperature, seed=config.training.seed)
    return SamplePrompts(tuple(v.sample_prompts), ids, v.sample_max_new_tokens, sampling, tokenizer)
