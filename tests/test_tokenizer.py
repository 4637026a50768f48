import base64
import json
import sys
from pathlib import Path

import pytest
import tokenizers

from torchtitan_amp.data import DataError
from torchtitan_amp.data.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, build_tokenizer

TEXTS = ["hello world", "héllo wörld – naïve façade, 日本語テキスト", "emoji 👋🏽🚀 and 🇫🇷 flags", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    for bos in (False, True):
        for eos in (False, True):
            assert tok.decode(tok.encode(text, bos=bos, eos=eos)) == text


def test_byte_special_ids() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert tok.encode("hi", bos=True, eos=True) == [256, 104, 105, 257]
    assert tok.encode("hi", bos=False, eos=False) == [104, 105]
    assert tok.encode("é", bos=False, eos=True) == [0xC3, 0xA9, 257]


def test_byte_decode_skips_specials_and_replaces_broken_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([256, 104, 256, 105, 257, 257]) == "hi"
    # A window may cut a multi-byte character in half.
    assert tok.decode([0xC3]) == "\ufffd"


def test_byte_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="258"):
        ByteTokenizer().decode([104, 258])


def test_build_tokenizer_byte() -> None:
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def test_build_tokenizer_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(DataError, match="nope/tokenizer.json"):
        build_tokenizer(str(missing))


def test_hf_tokenizer_without_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import tokenizers` fail whether or not it is installed.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HFTokenizer(tmp_path / "tokenizer.json")


def _write_hf_tokenizer(path: Path, special_tokens: list[str]) -> Path:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        # The full byte alphabet makes any text (emoji included) encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 4, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_round_trip(tmp_path: Path) -> None:
    path = _write_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.vocab_size > 256
    for text in TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.bos_id not in ids[1:-1] and tok.eos_id not in ids[1:-1]
        assert tok.decode(ids) == text
    assert tok.encode("hello", bos=False, eos=False) == tok.encode("hello", bos=True, eos=True)[1:-1]


def test_hf_tokenizer_gpt2_style_endoftext_is_bos_and_eos(tmp_path: Path) -> None:
    tok = build_tokenizer(str(_write_hf_tokenizer(tmp_path / "tokenizer.json", ["<|endoftext|>"])))
    assert tok.bos_id == tok.eos_id == 0


def test_hf_tokenizer_without_special_tokens_names_file(tmp_path: Path) -> None:
    path = _write_hf_tokenizer(tmp_path / "plain.json", ["<pad>"])
    with pytest.raises(DataError, match=r"plain\.json.*no BOS/EOS"):
        build_tokenizer(str(path))


def test_hf_tokenizer_malformed_file_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(DataError, match=r"broken\.json: cannot load tokenizer"):
        build_tokenizer(str(path))


def test_hf_fingerprint_follows_the_ids_not_the_file_bytes(tmp_path: Path) -> None:
    path = _write_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    reindented = tmp_path / "reindented.json"
    reindented.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    other = _write_hf_tokenizer(tmp_path / "other.json", ["<s>", "</s>", "<pad>"])
    fingerprints = [build_tokenizer(str(p)).fingerprint for p in (path, reindented, other)]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert fingerprints[0] != ByteTokenizer().fingerprint


def _write_tiktoken(path: Path, merges: list[bytes]) -> Path:
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def test_tiktoken_llama3_layout_round_trip_and_specials_as_text(tmp_path: Path) -> None:
    tok = build_tokenizer(str(_write_tiktoken(tmp_path / "tokenizer.model", [b"he", b"ll", b"hell", b"hello"])))
    assert isinstance(tok, TiktokenTokenizer)
    # Llama 3: 256 specials after the ranks, BOS first, EOS second (128000 / 128001 for its 128000 ranks).
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (260 + 256, 260, 261)
    assert tok.encode("hello", bos=True, eos=True) == [260, 259, 261]
    for text in TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == text
    # Corpus text that spells a special token stays text.
    ids = tok.encode("<|end_of_text|>", bos=False, eos=False)
    assert tok.eos_id not in ids and tok.decode(ids) == "<|end_of_text|>"
    assert tok.encode_batch(["hello", "hi"]) == [[259], [104, 105]]


def _llama3_split(s: str, max_run: int = 25_000) -> list[str]:
    """meta-llama/llama3's _split_whitespaces_or_nonwhitespaces, transcribed as the reference."""
    pieces, run, run_is_space, start = [], 0, s[0].isspace() if s else False, 0
    for i, ch in enumerate(s):
        if run_is_space ^ ch.isspace():
            run, run_is_space = 1, ch.isspace()
        else:
            run += 1
            if run > max_run:
                pieces.append(s[start:i])
                start, run = i, 1
    return pieces + [s[start:]]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "short text",
        "a" * 25_000,
        "a" * 25_001,
        "a" * 60_001 + " " * 30_000 + "b",
        " " * 50_001 + "x" * 24_999,
        "word " * 100_000,
        "\n" * 25_001 + "é" * 75_000,
    ],
)
def test_tiktoken_long_runs_are_cut_like_llama3(tmp_path: Path, text: str) -> None:
    from torchtitan_amp.data.tokenizer import _tiktoken_pieces

    # Llama 3's encode: 400,000-character chunks, each split as above.
    reference = [p for i in range(0, len(text), 400_000) for p in _llama3_split(text[i : i + 400_000])]
    assert list(_tiktoken_pieces(text)) == reference
    tok = build_tokenizer(str(_write_tiktoken(tmp_path / "t.model", [b"aa"])))
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_tiktoken_bad_file_names_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.model"
    bad.write_text("not-base64!! 0\n")
    with pytest.raises(DataError, match=r"broken\.model: cannot load tiktoken BPE file"):
        build_tokenizer(str(bad))
    gappy = tmp_path / "gappy.model"
    gappy.write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(DataError, match=r"gappy\.model: tiktoken ranks must be 0..n-1"):
        build_tokenizer(str(gappy))
