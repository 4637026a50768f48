"""Which tokens a token may attend to (`model.attn_mask_type`), shared by every model family.

"causal": every earlier token of the window. "block_causal" (document masking): only the earlier
tokens of its own document, so that packed windows train as if each document were alone; the
boundaries come from the tokens themselves (a BOS starts a document, so does the token after an
EOS), whatever the dataset kind; for chat data only a BOS does (every conversation starts with one,
and an end-of-turn EOS inside a conversation must not cut it).

Two backends run it (`model.attention_backend`, decided once by `decide_backend`, which the
precision plan records and reports):

- "sdpa": the mask is handed to SDPA as a boolean tensor: it runs on CPU and CUDA alike, at the
  cost of one B x S x S bool per forward and, on CUDA, SDPA's memory-efficient kernel instead of
  flash. Plain causal attention takes SDPA's is_causal (flash on CUDA).
- "flex": FlexAttention with one BlockMask per distinct mask of the forward (documents, causal,
  a sliding window), built once from the document ids by `FlexMasks` and shared by every layer
  (and by later forwards with the same layout: `_shared_block_mask`, keyed by the document ids'
  values on the host, where a device batch's are known from the host batch it was copied from:
  `remember_host_copy`, no device sync): block-sparse, no [S, S] tensor. flex_attention is
  compiled once at module level (as torchtitan does); inside a compiled block (compile.enable)
  dynamo traces flex_attention itself over BlockMasks the model's forward built before the blocks
  (`FlexMasks.prepare`), so that no mask is built inside a graph. Under context parallel the keys are the
  all-gathered window's and the BlockMask covers [this rank's queries, the gathered keys], its
  mask_mod comparing window positions (`ShardedQueries`: the head-tail order makes a rank's
  queries two separate chunks). Measured on torch 2.11 and 2.13 CPU builds: forward runs eager and
  compiled, but any input that requires grad raises NotImplementedError (no CPU backward), and the
  compiled CPU kernel refuses return_lse (the sinks' merge then runs flex eagerly on CPU).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.core.rules import SDPA_PRIORITY


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """[B, S] ids -> [B, S] int32: per token, which document of its window it belongs to (0 for the
    part of a document the window starts in).

    Args:
        tokens: the token ids [B, S].
        bos_id: the tokenizer's beginning-of-sequence id (a document starts at it).
        eos_id: the tokenizer's end-of-sequence id (a document ends with it); -1: only BOS starts
            documents (chat data, whose turns may end with EOS inside one conversation).
    """
    starts = tokens == bos_id
    if eos_id >= 0:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    return starts.cumsum(dim=1, dtype=torch.int32)


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> [B, 1, S, S] bool (True: may attend), broadcast over heads. Every
    token sees itself, so no row is empty (SDPA would return NaN for it)."""
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


class MaskInputs:
    """The extra forward arguments a job's mask type needs: none for "causal", `doc_ids` for
    "block_causal". Computed from the input tokens on every rank (pipeline stages past the first
    see hidden states, not tokens, so the trainer hands them the ids). With `host_ids` (the flex
    backend) a device batch's ids also get their host copy, the BlockMask cache's key; SDPA needs
    none, so its steps skip that CPU pass."""

    def __init__(self, mask_type: str, bos_id: int, eos_id: int, host_ids: bool = False) -> None:
        # mask_type comes from the config, whose Literal already refused any other value.
        self.mask_type, self.bos_id, self.eos_id, self.host_ids = mask_type, bos_id, eos_id, host_ids

    def __call__(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.mask_type == "causal":
            return {}
        ids = document_ids(tokens, self.bos_id, self.eos_id)
        host = host_copy(tokens) if self.host_ids else None
        if host is not None and host is not tokens:  # the same ids on the host: the BlockMask cache key
            remember_host_copy(ids, document_ids(host, self.bos_id, self.eos_id))
        return {"doc_ids": ids}


_HOST_COPY = "_host_copy"


def remember_host_copy(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> torch.Tensor:
    """Keeps on `device_tensor` the host tensor that holds the same values (the batch it was copied
    from: data.loader.to_device), so that its contents can be compared without a device sync."""
    setattr(device_tensor, _HOST_COPY, host_tensor)
    return device_tensor


def host_copy(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s values on the host: `t` itself on the CPU, else the host tensor remembered with it, or
    None."""
    return t if t.device.type == "cpu" else getattr(t, _HOST_COPY, None)


def pinned_kernels() -> contextlib.AbstractContextManager[object]:
    """The SDPA backends and their order (rules.SDPA_PRIORITY: flash, efficient, math; cuDNN
    attention off) around a model's attention call, so that what runs is what rules.attention_kernel
    says (torch would put cuDNN first on sm90 / sm100). torch.compile traces it (torch 2.9+)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_PRIORITY], set_priority=True)


def cuda_capability() -> tuple[int, int] | None:
    """This process's CUDA device's compute capability, or None without one; read when a model
    is built (eager), kept on its attention modules, so that a compiled forward reads a constant."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # type: ignore[return-value]


def flex_missing() -> str | None:
    """Why this torch cannot run FlexAttention (the APIs the flex path uses), or None."""
    try:
        from torch.nn.attention.flex_attention import (  # noqa: F401
            AuxRequest,
            BlockMask,
            create_block_mask,
            flex_attention,
        )
    except ImportError as err:
        return f"torch {torch.__version__} has no FlexAttention ({err})"
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """`decide_backend`'s answer: which kernel every layer's attention calls, and why."""

    backend: str  # "sdpa" | "flex"
    reason: str

    def describe(self, masks: tuple[str, ...] = ()) -> str:
        """The start-up line."""
        extra = f" (layers with {', '.join(masks)})" if masks else ""
        return f"attention: {self.backend} in every layer{extra}: {self.reason}"


def decide_backend(
    setting: str, device_type: str, mask_type: str, masks: tuple[str, ...], cp: int, training: bool = True
) -> AttentionBackend:
    """model.attention_backend resolved for one job; a combination that cannot run is refused in
    one line (ConfigError). "auto": flex on CUDA where the mask is not plain causal (documents,
    sliding windows, sinks), under context parallel too (over the gathered keys, masked by window
    position); SDPA otherwise (plain causal: under context parallel its chunked causal path) and
    on CPU.

    Args:
        setting: model.attention_backend ("sdpa", "flex", "auto").
        device_type: the device the job runs on ("cuda", "cpu").
        mask_type: model.attn_mask_type ("causal", "block_causal").
        masks: what the family's layers add to the mask ("sliding window", "sinks"; empty for none).
        cp: the context-parallel degree.
        training: whether the job runs backward (evaluation alone may run flex on CPU).
    """
    special = ([f"{mask_type} documents"] if mask_type != "causal" else []) + list(masks)
    if setting == "sdpa":
        return AttentionBackend("sdpa", "model.attention_backend = 'sdpa'")
    missing = flex_missing()
    where = "'model.attention_backend' = 'flex'"
    if setting == "flex":
        if missing is not None:
            raise ConfigError(f"{where}: {missing}; use 'sdpa' or 'auto'")
        if training and device_type != "cuda":
            raise ConfigError(
                f"{where} cannot train on {device_type}: torch {torch.__version__} has no FlexAttention "
                "backward there (NotImplementedError); use 'sdpa' or 'auto'"
            )
        return AttentionBackend("flex", "model.attention_backend = 'flex'")
    if device_type != "cuda":
        return AttentionBackend("sdpa", f"auto on {device_type}: FlexAttention has no backward there")
    if missing is not None:
        return AttentionBackend("sdpa", f"auto: {missing}")
    if not special and cp > 1:
        return AttentionBackend("sdpa", f"auto, plain causal under context parallel {cp}: SDPA's chunked causal path")
    if not special:
        return AttentionBackend("sdpa", "auto, plain causal: SDPA's is_causal kernel (flash)")
    if cp > 1:
        return AttentionBackend(
            "flex",
            f"auto on CUDA with {', '.join(special)} under context parallel {cp}: a BlockMask over this rank's "
            "queries and the gathered keys by window position, no [S/cp, S] mask",
        )
    return AttentionBackend("flex", f"auto on CUDA with {', '.join(special)}: block-sparse BlockMask, no [S, S] mask")


@functools.cache
def _compiled_flex(compiled: bool) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention  # type: ignore[return-value]


def _flex(compiled: bool) -> Callable[..., Any]:
    """flex_attention, compiled once for the process (torchtitan's choice) or eager. Under a
    dispatch mode that dynamo steps aside for (the precision audit's recorder) nothing compiles,
    and torch 2.13's eager flex_attention compiles its higher-order op with fullgraph=True, which
    then finds no frame and raises: there the op runs uncompiled (its dense reference
    implementation, which the mode sees), through torch's own switch for that."""
    from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

    if not any_torch_dispatch_mode_on_stack():
        return _compiled_flex(compiled)
    import torch.nn.attention.flex_attention as fa

    def uncompiled(*args: Any, **kwargs: Any) -> Any:
        saved, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, True
        try:
            return fa.flex_attention(*args, **kwargs)
        finally:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved

    return uncompiled


@dataclass(frozen=True)
class ShardedQueries:
    """Under context parallel: where this rank's queries and the all-gathered keys sit in the
    window (the head-tail order: a rank's queries are two separate chunks), so that a BlockMask
    over [local queries, gathered keys] masks by window position."""

    q_pos: torch.Tensor  # [Sq] the queries' window positions
    kv_pos: torch.Tensor  # [Skv] the gathered keys' window positions, in their gathered order
    kv_doc_ids: torch.Tensor | None  # [B, Skv] the gathered keys' documents (None: one document)
    rank: tuple[int, int]  # (cp degree, cp rank): masks differ by rank


@dataclass
class FlexMasks:
    """The BlockMasks of one forward, built on first use from the document ids (None: one
    document) and kept for the other layers: one per (window, queries, keys). Queries are the last
    of the keys' positions (a KV cache's newest tokens), so causal is lower-right aligned; under
    context parallel (`sharded`) queries and keys are placed by their window positions instead,
    and `doc_ids` are the rank's queries' documents."""

    doc_ids: torch.Tensor | None
    batch: int
    device: torch.device
    built: dict[tuple[int | None, int, int], Any] = field(default_factory=dict)
    sharded: ShardedQueries | None = None
    # The shared cache's layout key, read here (eagerly): the ids' values from their host copy
    # (host_copy), the ids' identity where none is known, None without documents. Under context
    # parallel the gathered keys' documents (with the rank they fix the queries').
    layout: Any = field(init=False)

    def __post_init__(self) -> None:
        self.layout = None if self.layout_ids is None else _layout_key(self.layout_ids)

    @property
    def layout_ids(self) -> torch.Tensor | None:
        """The document ids the masks' layout follows: the gathered keys' under context parallel."""
        return self.sharded.kv_doc_ids if self.sharded is not None else self.doc_ids

    def prepare(self, windows: Iterable[int | None], q_len: int) -> FlexMasks:
        """Builds now (eagerly, before the blocks: torch.compile's units) the BlockMask of each of
        `windows` for `q_len` queries against this forward's keys (the same positions; under
        context parallel the gathered window), so that a compiled block only looks it up: dynamo
        traces flex_attention over it, and no BlockMask is built inside a graph.

        Args:
            windows: the layers' sliding windows (None: a layer without one).
            q_len: the forward's queries (this rank's under context parallel).
        """
        kv_len = self.sharded.kv_pos.shape[0] if self.sharded is not None else q_len
        for window in windows:
            self.block_mask(window, q_len, kv_len)
        return self

    def block_mask(self, window: int | None, q_len: int, kv_len: int) -> Any:
        """The BlockMask for `window` (keys q - k < window; None: no window), built once; inside a
        compiled region only looked up (`prepare` built it).

        Args:
            window: the layer's sliding window, or None.
            q_len: the queries, the last q_len of the kv_len positions.
            kv_len: the keys.
        """
        key = (window, q_len, kv_len)
        if key not in self.built:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"FlexMasks: no BlockMask for window {window}, {q_len} queries, {kv_len} keys inside a "
                    "compiled block: the model's forward prepares each before the blocks (FlexMasks.prepare)"
                )
            self.built[key] = _shared_block_mask(self, window, q_len, kv_len)
        return self.built[key]


def _layout_key(doc_ids: torch.Tensor) -> tuple[Any, ...]:
    """Document ids -> a hashable key equal for equal ids: their shape and bytes, read from the host
    copy (host_copy); without one (a device tensor from elsewhere) the tensor's identity, since reading
    a GPU's values would be a host sync (the host would wait for every queued kernel), costlier than
    create_block_mask (measured sync-free)."""
    host = host_copy(doc_ids)
    if host is None:
        return ("tensor", id(doc_ids))
    return ("ids", tuple(host.shape), str(host.dtype), host.detach().contiguous().numpy().tobytes())


# BlockMasks shared across forwards (the micro-batches of a step, steps, validation's batches) that
# have one layout: by shapes, window, device and layout key, each with the document ids it was built
# from, the least recently used dropped past _SHARED_MAX.
_SHARED: dict[tuple[Any, ...], tuple[torch.Tensor | None, Any]] = {}
_SHARED_MAX = 16


def clear_shared_masks() -> None:
    """Forget the shared BlockMasks."""
    _SHARED.clear()


def _shared_block_mask(masks: FlexMasks, window: int | None, q_len: int, kv_len: int) -> Any:
    """`_build_block_mask`'s BlockMask, or the one an earlier forward with the same layout built
    (under context parallel: the same rank and the same gathered keys' documents)."""
    doc_ids, batch, device, sharded = masks.doc_ids, masks.batch, masks.device, masks.sharded
    rank = sharded.rank if sharded is not None else None
    key = (window, q_len, kv_len, batch if doc_ids is not None else None, str(device), rank, masks.layout)
    hit = _SHARED.pop(key, None)
    # A key by identity holds its tensor (so that its id is not reused while the entry lives).
    if hit is not None:
        _SHARED[key] = hit  # now the most recently used
        return hit[1]
    if sharded is not None:
        mask = _build_sharded_block_mask(doc_ids, sharded, batch, window, q_len, kv_len, device)
    else:
        mask = _build_block_mask(doc_ids, batch, window, q_len, kv_len, device)
    _SHARED[key] = (masks.layout_ids, mask)
    while len(_SHARED) > _SHARED_MAX:
        _SHARED.pop(next(iter(_SHARED)))
    return mask


def _build_block_mask(
    doc_ids: torch.Tensor | None, batch: int, window: int | None, q_len: int, kv_len: int, device: torch.device
) -> Any:
    """create_block_mask of causal (lower-right), documents and window mask_mods.

    Args:
        doc_ids: [B, kv_len] the keys' documents, or None (one document).
        batch: the batch rows (with doc_ids).
        window: the sliding window, or None.
        q_len: the queries, the last q_len of the kv_len positions.
        kv_len: the keys.
        device: where the BlockMask is built.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len

    def _mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_pos = q_idx + offset
        allowed = kv_idx <= q_pos
        if window is not None:
            allowed = allowed & (q_pos - kv_idx < window)
        if doc_ids is not None:
            allowed = allowed & (doc_ids[b, q_pos] == doc_ids[b, kv_idx])
        return allowed

    rows = batch if doc_ids is not None else None
    return create_block_mask(_mask_mod, rows, None, q_len, kv_len, device=device)


def _build_sharded_block_mask(
    doc_ids: torch.Tensor | None,
    sharded: ShardedQueries,
    batch: int,
    window: int | None,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> Any:
    """create_block_mask over [this rank's queries, the gathered keys]: causal, window and
    documents by window position (q_pos[q_idx] against kv_pos[kv_idx]).

    Args:
        doc_ids: [B, q_len] the queries' documents, or None (one document).
        sharded: the queries' and keys' window positions and the keys' documents.
        batch: the batch rows (with doc_ids).
        window: the sliding window, or None.
        q_len: this rank's queries.
        kv_len: the gathered keys.
        device: where the BlockMask is built.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    q_pos, kv_pos, kv_docs = sharded.q_pos, sharded.kv_pos, sharded.kv_doc_ids
    if doc_ids is not None and kv_docs is None:
        raise ValueError("FlexMasks under context parallel: the queries' documents need the keys' (kv_doc_ids)")

    def _mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        qp, kp = q_pos[q_idx], kv_pos[kv_idx]
        allowed = kp <= qp
        if window is not None:
            allowed = allowed & (qp - kp < window)
        if doc_ids is not None and kv_docs is not None:
            allowed = allowed & (doc_ids[b, q_idx] == kv_docs[b, kv_idx])
        return allowed

    rows = batch if doc_ids is not None else None
    return create_block_mask(_mask_mod, rows, None, q_len, kv_len, device=device)


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: FlexMasks,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention's output [B, H, S, Dv] in v's dtype (its softmax statistics are fp32 inside
    the kernel). With `sinks` ([H]), each query's softmax gains a sink column: the output is
    rescaled by sigmoid(lse - sink), in fp32 (softmax over [scores, sink] = softmax(scores) x
    e^lse / (e^lse + e^sink)).

    Args:
        q: the queries [B, H, S, D].
        k: the keys [B, Hkv, Sk, D] (Hkv dividing H: grouped-query attention).
        v: the values [B, Hkv, Sk, Dv].
        masks: the forward's FlexMasks.
        window: this layer's sliding window (None: none).
        sinks: this layer's per-head sink logits, or None.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    block_mask = masks.block_mask(window, q.shape[2], k.shape[2])
    gqa = q.shape[1] != k.shape[1]
    flex: Callable[..., Any] = flex_attention  # in a compiled block: dynamo traces the op itself
    if not torch.compiler.is_compiling():
        # Compiled on its own, except where the compiled CPU kernel cannot: the sinks' lse.
        flex = _flex(sinks is None or q.device.type == "cuda")
    if sinks is None:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa).to(v.dtype)
    out, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    scale = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])
    return (out.float() * scale[..., None]).to(v.dtype)
