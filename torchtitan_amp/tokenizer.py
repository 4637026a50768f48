"""Tokenizers: a dependency-free byte tokenizer and a wrapper for Hugging Face tokenizer.json files."""

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


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json; BOS/EOS are added by us, not by its post-processor."""

    def __init__(self, path: str | Path) -> None:
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
        bos_id = _find_special(self._tokenizer, _BOS_NAMES)
        eos_id = _find_special(self._tokenizer, _EOS_NAMES)
        if bos_id is None or eos_id is None:
            raise DataError(
                f"{self.path}: no BOS/EOS special token found (allowed BOS: {', '.join(_BOS_NAMES)}; "
                f"EOS: {', '.join(_EOS_NAMES)})"
            )
        self.bos_id: int = bos_id
        self.eos_id: int = eos_id
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.cache_key = f"hf:{self.path.resolve()}"

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        # add_special_tokens=False stops the file's post-processor from adding its own BOS/EOS twice.
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return _add_specials(ids, self.bos_id, self.eos_id, bos, eos)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str) -> Tokenizer:
    """`spec` is "byte" or the path of a Hugging Face tokenizer.json file."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json file")
    return HFTokenizer(path)
