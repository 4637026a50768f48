import sys
from pathlib import Path

import pytest

from torchtitan_amp.data import DataError
from torchtitan_amp.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

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
    tokenizers = pytest.importorskip("tokenizers", reason="HF tokenizer tests need `pip install tokenizers`")
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
    pytest.importorskip("tokenizers", reason="HF tokenizer tests need `pip install tokenizers`")
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(DataError, match=r"broken\.json: cannot load tokenizer"):
        build_tokenizer(str(path))
