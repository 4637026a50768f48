"""Tokenizers: a dependency-free byte tokenizer and a wrapper for Hugging Face tokenizer.json files
or tokenizer folders (tokenizer.json + tokenizer_config.json, as published with the weights)."""

import json
from pathlib import Path
from typing import Any, Protocol

from torchtitan_amp.errors import DataError

# Checked in order; the first name present in the vocabulary wins. GPT-2 style vocabularies
# only have <|endoftext|>, which then serves as both BOS and EOS.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _add_specials(ids: list[int], bos_id: int, eos_id: int, bos: bool, eos: bool) -> list[int]:
    return ([bos_id] if bos else []) + ids + ([eos_id] if eos else [])


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS and EOS follow them so every text is encodable without a vocab file."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    # Identifies this tokenizer's output so tokenised corpora can be cached and shared (see data.py).
    cache_key = "byte"

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        return _add_specials(list(text.encode("utf-8")), self.bos_id, self.eos_id, bos, eos)

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
        try:
            self._tokenizer = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{self.path}: cannot load tokenizer: {' '.join(str(e).split())}") from e
        for field, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None and self._tokenizer.token_to_id(token) is None:
                raise DataError(f"{self.path.parent / 'tokenizer_config.json'}: '{field}' {token!r} is not in "
                                f"the vocabulary of {self.path}")
        bos_id = _find_special(self._tokenizer, (bos_token,) if bos_token else _BOS_NAMES)
        eos_id = _find_special(self._tokenizer, (eos_token,) if eos_token else _EOS_NAMES)
        if bos_id is None or eos_id is None:
            raise DataError(
                f"{self.path}: no BOS/EOS special token found (allowed BOS: {', '.join(_BOS_NAMES)}; "
                f"EOS: {', '.join(_EOS_NAMES)})"
            )
        self.bos_id: int = bos_id
        self.eos_id: int = eos_id
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.cache_key = f"hf:{self.path.resolve()}"
        if bos_token or eos_token:  # tokenizer_config.json chose the specials: other ids, other cache
            self.cache_key += f":{bos_id}:{eos_id}"

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        # add_special_tokens=False stops the file's post-processor from adding its own BOS/EOS twice.
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return _add_specials(ids, self.bos_id, self.eos_id, bos, eos)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str) -> Tokenizer:
    """`spec` is "byte", the path of a Hugging Face tokenizer.json file, or a folder holding one
    (and, optionally, the tokenizer_config.json that names its BOS and EOS tokens)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(f"tokenizer folder {spec} has no tokenizer.json (a Hugging Face tokenizer folder needs one)")
        config = path / "tokenizer_config.json"
        bos, eos = _special_names(config) if config.is_file() else (None, None)
        return HFTokenizer(path / "tokenizer.json", bos, eos)
    if not path.is_file():
        raise DataError(f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json file or folder")
    return HFTokenizer(path)
