"""Tokenizers: a dependency-free byte tokenizer, Hugging Face tokenizer.json files or tokenizer
folders (tokenizer.json + tokenizer_config.json, as published with the weights) and tiktoken BPE
files (Llama 3's `tokenizer.model`).

Every tokenizer has a `fingerprint` that changes whenever its ids would: token shards record it
(data/index.py) so a run cannot silently train on ids from another vocabulary.
"""

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from torchtitan_amp.core.errors import DataError

# Checked in order; the first name present in the vocabulary wins. GPT-2 style vocabularies
# only have <|endoftext|>, which then serves as both BOS and EOS.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    fingerprint: str
    # training.chat_template ("": the tokenizer's own): which chat template data/chat_template.py renders.
    chat_template: str

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """The ids of `text`, with BOS and EOS as asked.

        Args:
            text: the text to encode.
            bos: whether to put bos_id first.
            eos: whether to put eos_id last.
        """
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text without BOS/EOS (the prepare step's bulk path)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


def _add_specials(ids: list[int], bos_id: int, eos_id: int, bos: bool, eos: bool) -> list[int]:
    return ([bos_id] if bos else []) + ids + ([eos_id] if eos else [])


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS and EOS follow them so every text is encodable without a vocab file."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    # Identifies this tokenizer's output so tokenised corpora can be cached and shared (data/text.py).
    cache_key = "byte"
    fingerprint = "byte:utf8-258"
    chat_template = ""

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """The UTF-8 bytes of `text` as ids, with BOS and EOS as asked.

        Args:
            text: the text to encode.
            bos: whether to put bos_id first.
            eos: whether to put eos_id last.
        """
        return _add_specials(list(text.encode("utf-8")), self.bos_id, self.eos_id, bos, eos)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range for ByteTokenizer (allowed: 0..{self.vocab_size - 1})")
        # A window can start or end mid-character, so invalid UTF-8 must not raise.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _find_special(hf_tokenizer: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        token_id = hf_tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _special_names(config_path: Path) -> tuple[str | None, str | None]:
    """tokenizer_config.json's bos_token and eos_token (a string or {"content": ...}), if any."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{config_path}: unreadable ({' '.join(str(e).split())})") from None

    def name(field: str) -> str | None:
        value = config.get(field) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(value, str):
            raise DataError(f"{config_path}: '{field}' must be a token string, got {value!r}")
        return value

    return name("bos_token"), name("eos_token")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json; BOS/EOS are added by us, not by its post-processor.

    `bos_token`/`eos_token` (from a folder's tokenizer_config.json) name the special tokens; without
    them the first known name in the vocabulary is used."""

    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None) -> None:
        try:
            # Optional dependency: only users of tokenizer.json files need it.
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ImportError(f"loading {path} needs the `tokenizers` package: pip install tokenizers") from e
        self.path = Path(path)
        self.chat_template = ""
        try:
            self._tokenizer = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{self.path}: cannot load tokenizer: {' '.join(str(e).split())}") from e
        # The vocabulary's special tokens, id -> string, read once (every chat conversation asks).
        self._specials = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        for field, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None and self._tokenizer.token_to_id(token) is None:
                raise DataError(
                    f"{self.path.parent / 'tokenizer_config.json'}: '{field}' {token!r} is not in "
                    f"the vocabulary of {self.path}"
                )
        bos_id = _find_special(self._tokenizer, (bos_token,) if bos_token else _BOS_NAMES)
        eos_id = _find_special(self._tokenizer, (eos_token,) if eos_token else _EOS_NAMES)
        if bos_id is None or eos_id is None:
            raise DataError(
                f"{self.path}: no BOS/EOS special token found (allowed BOS: {', '.join(_BOS_NAMES)}; "
                f"EOS: {', '.join(_EOS_NAMES)})"
            )
        self.bos_id: int = bos_id
        self.eos_id: int = eos_id
        # The specials' strings, which chat templates render as `bos_token` / `eos_token`.
        self.bos_token: str = self._tokenizer.id_to_token(bos_id) or ""
        self.eos_token: str = self._tokenizer.id_to_token(eos_id) or ""
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.cache_key = f"hf:{self.path.resolve()}"
        # The library's own serialisation, not the file's bytes: re-saving or re-indenting the file
        # keeps the ids, and so the fingerprint.
        self.fingerprint = "hf:" + hashlib.sha256(self._tokenizer.to_str().encode()).hexdigest()
        if bos_token or eos_token:  # tokenizer_config.json chose the specials: other ids, other data
            self.cache_key += f":{bos_id}:{eos_id}"
            self.fingerprint += f":bos{bos_id}:eos{eos_id}"

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        # add_special_tokens=False stops the file's post-processor from adding its own BOS/EOS twice.
        """The ids of `text` by the tokenizer file (without its post-processor's specials), with BOS and
        EOS as asked.

        Args:
            text: the text to encode.
            bos: whether to put bos_id first.
            eos: whether to put eos_id last.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return _add_specials(ids, self.bos_id, self.eos_id, bos, eos)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def special_tokens(self) -> list[str]:
        """The strings of the vocabulary's special tokens (what a chat template's markers may be)."""
        return list(self._specials.values())

    def _encode(self, text: str, split_specials: bool) -> tuple[list[int], list[tuple[int, int]]]:
        tok = self._tokenizer
        before = tok.encode_special_tokens
        tok.encode_special_tokens = split_specials  # transformers' split_special_tokens
        try:
            encoding = tok.encode(text, add_special_tokens=False)
        finally:
            tok.encode_special_tokens = before
        return encoding.ids, [(a, b) for a, b in encoding.offsets]

    def encode_with_offsets(
        self, text: str, literal: frozenset[int] = frozenset()
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` as `encode` (no BOS/EOS added; specials spelled in the text are
        matched, as transformers' apply_chat_template tokenises), with each token's character span.

        Args:
            text: the text.
            literal: character positions where a special token's string is text, not the special
                (a chat message spelled it): each stretch between the specials matched elsewhere
                that holds one is tokenised with specials split (transformers' split_special_tokens).
        """
        ids, offsets = self._encode(text, False)
        special = self._specials
        if not any(i in special and offsets[k][0] in literal for k, i in enumerate(ids)):
            return ids, offsets
        cuts = [k for k, i in enumerate(ids) if i in special and offsets[k][0] not in literal]
        out_ids: list[int] = []
        out_offsets: list[tuple[int, int]] = []
        first, start = 0, 0  # the stretch's first token and first character
        for cut in [*cuts, len(ids)]:
            if any(ids[k] in special for k in range(first, cut)):  # only literal ones in between
                end = offsets[cut][0] if cut < len(ids) else len(text)
                sub_ids, sub_offsets = self._encode(text[start:end], True)
                out_ids += sub_ids
                out_offsets += [(a + start, b + start) for a, b in sub_offsets]
            else:
                out_ids += ids[first:cut]
                out_offsets += offsets[first:cut]
            if cut < len(ids):
                out_ids.append(ids[cut])
                out_offsets.append(offsets[cut])
                start = offsets[cut][1]
            first = cut + 1
        return out_ids, out_offsets

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


# Llama 3's pre-tokenizer pattern and special tokens (meta-llama/llama3 tokenizer.py): the 256
# specials follow the file's ranks, so Llama 3's 128,000 ranks give vocab 128,256, BOS 128,000.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPECIALS = (
    ["<|begin_of_text|>", "<|end_of_text|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
)
# Llama 3 encodes at most 400k characters at a time and cuts runs of over 25k (non-)whitespace
# characters, which would otherwise make tiktoken's regex quadratic.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{_TIKTOKEN_MAX_RUN + 1},}}|\S{{{_TIKTOKEN_MAX_RUN + 1},}}")


def _tiktoken_pieces(text: str) -> Iterator[str]:
    """Llama 3's split of `text`: the same cuts as its per-character loop, found by a regex."""
    for begin in range(0, len(text), _TIKTOKEN_MAX_CHARS):
        chunk = text[begin : begin + _TIKTOKEN_MAX_CHARS]
        start = 0
        for run in _LONG_RUN.finditer(chunk):
            for cut in range(run.start() + _TIKTOKEN_MAX_RUN, run.end(), _TIKTOKEN_MAX_RUN):
                yield chunk[start:cut]
                start = cut
        yield chunk[start:]


class TiktokenTokenizer:
    """A tiktoken BPE file (`base64-token rank` lines, e.g. Llama 3's tokenizer.model) with Llama 3's
    pattern and specials. Text that spells a special token is encoded as plain text, never as it."""

    def __init__(self, path: str | Path) -> None:
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ImportError(f"loading {path} needs the `tiktoken` package: pip install tiktoken") from e
        self.path = Path(path)
        self.chat_template = ""
        try:
            ranks = load_tiktoken_bpe(str(self.path))
        except Exception as e:  # malformed lines raise ValueError or binascii.Error
            raise DataError(f"{self.path}: cannot load tiktoken BPE file: {' '.join(str(e).split())}") from e
        if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
            raise DataError(f"{self.path}: tiktoken ranks must be 0..n-1 without gaps")
        self._num_base = len(ranks)
        specials = {name: self._num_base + i for i, name in enumerate(_LLAMA3_SPECIALS)}
        self._encoding = tiktoken.Encoding(
            name=self.path.name, pat_str=_LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self.bos_id: int = specials["<|begin_of_text|>"]
        self.eos_id: int = specials["<|end_of_text|>"]
        self.vocab_size: int = self._num_base + len(specials)
        self.cache_key = f"tiktoken:{self.path.resolve()}"
        self.fingerprint = "tiktoken-llama3:" + hashlib.sha256(self.path.read_bytes()).hexdigest()

    def _ids(self, text: str) -> list[int]:
        return [i for piece in _tiktoken_pieces(text) for i in self._encoding.encode_ordinary(piece)]

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """The ids of `text` by the tiktoken ranks, with BOS and EOS as asked.

        Args:
            text: the text to encode.
            bos: whether to put bos_id first.
            eos: whether to put eos_id last.
        """
        return _add_specials(self._ids(text), self.bos_id, self.eos_id, bos, eos)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._ids(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode([i for i in ids if i < self._num_base])


def _is_json(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(64).lstrip()[:1] == b"{"


def build_tokenizer(spec: str) -> Tokenizer:
    """`spec` is "byte", a Hugging Face tokenizer.json or a tiktoken BPE file (told apart by
    content), or a folder holding a tokenizer.json (and, optionally, the tokenizer_config.json that
    names its BOS and EOS tokens)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(
                f"tokenizer folder {spec} has no tokenizer.json (a Hugging Face tokenizer folder needs one)"
            )
        config = path / "tokenizer_config.json"
        bos, eos = _special_names(config) if config.is_file() else (None, None)
        return HFTokenizer(path / "tokenizer.json", bos, eos)
    if not path.is_file():
        raise DataError(
            f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json or tiktoken BPE file, "
            "nor a Hugging Face tokenizer folder"
        )
    return HFTokenizer(path) if _is_json(path) else TiktokenTokenizer(path)
