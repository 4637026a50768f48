"""`chat:FILE`: supervised fine-tuning on conversations, loss on the assistant tokens only.

FILE is a .jsonl of {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}.
Each conversation is rendered by the tokenizer's chat template (data/chat_template.py) and
tokenised whole; a token is trained when its first character lies in an assistant span, every
other label is IGNORE_INDEX (so the loss's global valid-label normalisation counts only assistant
tokens). An example starts with BOS (put in front when the template renders none), which is where
`block_causal` document masking starts a document: for chat data only BOS does (models/attention.py's
`MaskInputs`), so an end-of-turn EOS inside a conversation does not cut it.

Examples are packed whole, in file order, into windows of seq_len + 1 tokens (next fit; the rest
of a window is EOS padding whose labels are ignored), so an example never shares attention with
another under block_causal and never loses its prompt to a window edge. An example longer than a
window is cut to it, and the cut is logged: how many examples, how many tokens, which examples.
The windows are then served like `path:`'s (PackedTextDataset: seeded order, data-parallel share,
resumable position).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data.chat_template import BYTE_BOS_TOKEN, BYTE_EOS_TOKEN, ROLES, ChatTemplate, template_for
from torchtitan_amp.data.packed import PackedTextDataset, Sample
from torchtitan_amp.data.tokenizer import Tokenizer
from torchtitan_amp.models.loss import IGNORE_INDEX

logger = logging.getLogger("torchtitan_amp")

Messages = list[dict[str, str]]


def _message_error(where: str, j: int, message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"message {j} is not a JSON object"
    role, content = message.get("role"), message.get("content")
    if role is None:
        return f"message {j} has no 'role' (one of {', '.join(ROLES)})"
    if role not in ROLES:
        return f"message {j} has role {role!r}, not one of {', '.join(ROLES)}"
    if not isinstance(content, str):
        return f"message {j} ({role}) has no string 'content'"
    return None


def parse_conversation(line: str, where: str) -> Messages:
    """One jsonl line's messages, checked (DataError naming `where` otherwise).

    Args:
        line: the line's text.
        where: "FILE:LINE", for the error message.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a JSON object with a non-empty 'messages' list")
    for j, message in enumerate(messages):
        error = _message_error(where, j, message)
        if error is not None:
            raise DataError(f"{where}: {error}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_conversations(path: Path) -> list[tuple[str, Messages]]:
    """("FILE:LINE", messages) of every non-blank line of `path`.

    Args:
        path: the .jsonl file.
    """
    if not path.is_file():
        raise DataError(f"chat dataset {path} does not exist (chat:FILE needs a .jsonl file)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (bad byte at offset {e.start})") from None
    out = [
        (f"{path}:{n}", parse_conversation(line, f"{path}:{n}"))
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not out:
        raise DataError(f"chat dataset {path} is empty (no conversations)")
    return out


def _byte_encode_with_offsets(
    text: str, bos_id: int, eos_id: int, literal: frozenset[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The byte tokenizer's ids of a rendered chat: BYTE_BOS_TOKEN / BYTE_EOS_TOKEN spelled in the
    text are its BOS / EOS ids (as a Hugging Face tokenizer matches its specials), except where
    `literal` says a message spelled them; the rest bytes."""
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    i = 0
    while i < len(text):
        for token, token_id in ((BYTE_BOS_TOKEN, bos_id), (BYTE_EOS_TOKEN, eos_id)):
            if i not in literal and text.startswith(token, i):
                ids.append(token_id)
                offsets.append((i, i + len(token)))
                i += len(token)
                break
        else:
            encoded = text[i].encode("utf-8")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))
            i += 1
    return ids, offsets


def encode_chat(text: str, tokenizer: Tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    """A rendered chat's ids (the template's specials matched, nothing added) and character spans.
    Special strings that a message spelled (a RenderedChat's `literal` positions) are text: user
    text never becomes a special token.

    Args:
        text: the rendered conversation (ChatTemplate.render's RenderedChat; a plain str matches
            every special string in it).
        tokenizer: the byte tokenizer or a Hugging Face one.
    """
    literal: frozenset[int] = getattr(text, "literal", frozenset())
    if getattr(tokenizer, "cache_key", None) == "byte":
        return _byte_encode_with_offsets(text, tokenizer.bos_id, tokenizer.eos_id, literal)
    return tokenizer.encode_with_offsets(text, literal)  # type: ignore[attr-defined]  # template_for checked it


def chat_prompt_ids(messages: Messages, tokenizer: Tokenizer, template: ChatTemplate | None = None) -> list[int]:
    """The ids a model continues to answer `messages`: rendered with the generation prompt,
    BOS first (as training saw every example).

    Args:
        messages: the conversation so far ({"role", "content"} dicts).
        tokenizer: the model's tokenizer.
        template: its chat template (None: template_for(tokenizer)).
    """
    template = template or template_for(tokenizer)
    ids, _ = encode_chat(template.render(messages, add_generation_prompt=True), tokenizer)
    return ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id, *ids]


def example_tokens(
    messages: Messages, template: ChatTemplate, tokenizer: Tokenizer, where: str = "conversation"
) -> tuple[list[int], list[bool]]:
    """One conversation's ids (BOS first) and, per id, whether it is an assistant token.

    Args:
        messages: the conversation.
        template: the chat template.
        tokenizer: the tokenizer.
        where: "FILE:LINE", for the error message.
    """
    text, spans = template.assistant_spans(messages)
    if not spans:
        raise DataError(
            f"{where}: the chat template ({template.where}) renders no assistant turn: no token would be trained"
        )
    ids, offsets = encode_chat(text, tokenizer)
    trained = [any(a <= start < b for a, b in spans) for start, _ in offsets]
    if ids[:1] != [tokenizer.bos_id]:
        ids, trained = [tokenizer.bos_id, *ids], [False, *trained]
    return ids, trained


@dataclass
class PackStats:
    """What packing did: examples, windows, trained tokens, and what truncation cut."""

    examples: int = 0
    windows: int = 0
    trained_tokens: int = 0
    padding: int = 0
    cut_examples: list[str] = field(default_factory=list)  # "FILE:LINE" of each cut example
    cut_tokens: int = 0

    def describe(self, source: str, window: int) -> str:
        """The start-up line."""
        return (
            f"chat data {source}: {self.examples} conversations packed into {self.windows} windows of "
            f"{window} tokens, {self.trained_tokens} assistant tokens trained, {self.padding} padding"
        )

    def truncation(self, source: str, window: int) -> str | None:
        """What truncation cut (None: nothing): how many examples and tokens, and which examples."""
        if not self.cut_examples:
            return None
        shown = ", ".join(self.cut_examples[:5]) + (", ..." if len(self.cut_examples) > 5 else "")
        return (
            f"chat data {source}: truncation cut {len(self.cut_examples)} examples longer than {window} "
            f"tokens ({self.cut_tokens} tokens dropped; {shown}); raise training.seq_len to keep them"
        )


def pack(
    examples: list[tuple[str, list[int], list[bool]]], window: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, PackStats]:
    """Whole examples packed next-fit into windows of `window` tokens: the int32 token stream
    (windows back to back), a bool per token (trained or not) and the stats.

    Args:
        examples: ("FILE:LINE", ids, trained) per example, in order.
        window: tokens per window (seq_len + 1).
        pad_id: the id that fills a window's rest (its labels are ignored).
    """
    stats = PackStats(examples=len(examples))
    tokens: list[int] = []
    trained: list[bool] = []
    used = 0  # tokens in the current window
    for where, ids, mask in examples:
        if len(ids) > window:
            stats.cut_examples.append(where)
            stats.cut_tokens += len(ids) - window
            ids, mask = ids[:window], mask[:window]
        if used and used + len(ids) > window:
            stats.padding += window - used
            tokens += [pad_id] * (window - used)
            trained += [False] * (window - used)
            used = 0
        tokens += ids
        trained += mask
        used = (used + len(ids)) % window
    if used:
        stats.padding += window - used
        tokens += [pad_id] * (window - used)
        trained += [False] * (window - used)
    stats.windows = len(tokens) // window
    stats.trained_tokens = sum(trained)
    return torch.tensor(tokens, dtype=torch.int32), torch.tensor(trained, dtype=torch.bool), stats


class ChatWindows(PackedTextDataset):
    """PackedTextDataset over packed chat windows whose labels are IGNORE_INDEX where the target
    token is not an assistant token.

    Args:
        tokens: the packed int32 stream (whole windows).
        trained: a bool per token of `tokens`.
        seq_len: tokens per sequence (windows are seq_len + 1).
        dp_rank: this rank's data-parallel index.
        dp_world_size: the data-parallel degree.
        seed: the seed of the window order.
    """

    def __init__(
        self, tokens: torch.Tensor, trained: torch.Tensor, seq_len: int, dp_rank: int, dp_world_size: int, seed: int
    ) -> None:
        super().__init__(tokens, seq_len, dp_rank, dp_world_size, seed)
        self._trained = trained

    def _next_sample(self) -> Sample:
        start = self._window_of(self.global_sample(self._produced)) * self._window
        self._produced += 1
        window = self._tokens[start : start + self._window].to(torch.int64)
        trained = self._trained[start + 1 : start + self._window]
        labels = torch.where(trained, window[1:], torch.full_like(window[1:], IGNORE_INDEX))
        return window[:-1], labels


_CACHE: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def chat_windows(dataset: str, tokenizer: Tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chat:FILE`'s packed stream and trained-token mask, built once per process (and logged).

    Args:
        dataset: "chat:FILE".
        tokenizer: the tokenizer (and, through it, the chat template).
        seq_len: tokens per sequence.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    key = (dataset, f"{getattr(tokenizer, 'cache_key', id(tokenizer))}|{tokenizer.chat_template}", seq_len)
    if key in _CACHE:
        return _CACHE[key]
    path = Path(dataset.removeprefix("chat:"))
    template = template_for(tokenizer)
    examples = []
    inner_bos = 0
    for where, messages in load_conversations(path):
        ids, mask = example_tokens(messages, template, tokenizer, where)
        inner_bos += tokenizer.bos_id in ids[1:]
        examples.append((where, ids, mask))
    tokens, trained, stats = pack(examples, seq_len + 1, tokenizer.eos_id)
    logger.info(stats.describe(str(path), seq_len + 1))
    if inner_bos:
        logger.warning(
            "chat data %s: %d conversations hold a BOS past their start (the template renders bos_token "
            "per turn): under block_causal their turns attend only within themselves",
            path,
            inner_bos,
        )
    cut = stats.truncation(str(path), seq_len + 1)
    if cut is not None:
        logger.warning(cut)
    _CACHE[key] = (tokens, trained)
    return tokens, trained
