"""Token shards: prepare (formats, tokenizers, workers, machines, crashes) and the tokens: loader
(windows, dp ranks, resume, start-up checks), on small corpora made here."""

from __future__ import annotations

import base64
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch

import torchtitan_amp.data.prepare as prepare_module
from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.data import DataError, ParallelAwareDataLoader, build_dataloader, load_texts, tokenize_corpus
from torchtitan_amp.data.cli import main as cli_main
from torchtitan_amp.data.index import read_index, verify
from torchtitan_amp.data.packed import PackedTextDataset
from torchtitan_amp.data.prepare import PrepareConfig, merge, prepare
from torchtitan_amp.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtitan_amp.data.tokens import WindowOrder
from torchtitan_amp.train import trainer as trainer_module

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu naïve façade 日本 👋".split()


def _text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of .txt, .md and .jsonl files: ~60 documents, ~25 kB."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(_text(0, 300))
    (root / "sub" / "b.md").write_text("# " + _text(1, 200))
    (root / "empty.txt").write_text("")
    lines = [json.dumps({"text": _text(10 + i, 20 + 7 * i), "id": i}) for i in range(60)]
    (root / "sub" / "c.jsonl").write_text("\n".join(lines[:30]) + "\n\n" + "\n".join(lines[30:]) + "\n")
    return root


def _prepare(inputs: list[Path | str], out: Path, **kwargs) -> Path:
    cfg = PrepareConfig(inputs=[str(p) for p in inputs], output=out, progress=False, **kwargs)
    prepare(cfg)
    return out


def _stream(folder: Path, split: str = "train") -> np.ndarray:
    index = read_index(folder)
    dtype = np.dtype("<u2") if index["dtype"] == "uint16" else np.dtype("<u4")
    return np.concatenate([np.fromfile(folder / s["file"], dtype=dtype) for s in index["splits"][split]["shards"]])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _epoch_rows(loader, batches: int) -> list[tuple[int, ...]]:
    """The seq_len + 1 token windows of the first `batches` batches."""
    it, rows = iter(loader), []
    for _ in range(batches):
        inputs, labels = next(it)
        rows += [tuple(row) for row in torch.cat([inputs, labels[:, -1:]], dim=1).tolist()]
    return rows


# --- prepare: round trip, formats, tokenizers ----------------------------------------------


def test_round_trip_matches_in_memory_path(corpus: Path, tmp_path: Path) -> None:
    # 4 kB shards: several shards, so windows cross shard ends.
    out = _prepare([corpus], tmp_path / "tok", shard_mb=4 / 1024)
    index = read_index(out)
    assert index["dtype"] == "uint16" and len(index["splits"]["train"]["shards"]) >= 4
    reference = tokenize_corpus(load_texts(f"path:{corpus}"), TOK).numpy()
    assert np.array_equal(_stream(out), reference)
    assert index["splits"]["train"]["num_docs"] == 62  # a.txt, b.md, 60 lines; empty.txt dropped
    # One epoch of windows is the in-memory path's windows, in another order.
    loader = build_dataloader(f"tokens:{out}", TOK, seq_len=63, local_batch_size=1, dp_rank=0, dp_world_size=1, seed=3)
    packed = PackedTextDataset(torch.from_numpy(reference.astype(np.int32)), 63, 0, 1, seed=3)
    n = loader.num_windows_per_epoch
    assert n == packed.num_windows_per_epoch == reference.size // 64
    mine = _epoch_rows(loader, n)
    theirs = [tuple(torch.cat([x, y[-1:]]).tolist()) for x, y in (next(iter(packed)) for _ in range(n))]
    assert sorted(mine) == sorted(theirs) and mine != sorted(mine)
    assert loader.epoch == 0


def test_compressed_and_parquet_inputs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = [_text(i, 5 + i) for i in range(9)]
    jsonl = "".join(json.dumps({"text": d}) + "\n" for d in docs[:4]).encode()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "in" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    (tmp_path / "in" / "c.txt.gz").write_bytes(gzip.compress(docs[4].encode()))
    # Two row groups, a null and an empty string (both skipped), another column.
    table = pa.table({"id": list(range(6)), "body": docs[5:9] + [None, ""]})
    pq.write_table(table, tmp_path / "in" / "d.parquet", row_group_size=3)
    out = _prepare([tmp_path / "in"], tmp_path / "tok", text_column="body")
    expected = docs[:4] + docs[:4] + docs[4:9]
    assert np.array_equal(_stream(out), tokenize_corpus([("", d) for d in expected], TOK).numpy())


def test_saved_and_by_name_hugging_face_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `datasets` (a requirement) makes the input; prepare reads its .arrow files with pyarrow.
    docs = [_text(i, 5 + i) for i in range(5)]
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "saved"))
    out = _prepare([tmp_path / "saved"], tmp_path / "tok", text_column="body")
    assert np.array_equal(_stream(out), tokenize_corpus([("", d) for d in docs], TOK).numpy())
    # By name: load_dataset's own cache files (a local JSON builder stands in for the hub).
    (tmp_path / "hub.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    real_load = datasets.load_dataset
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda name, config, split: real_load(
            "json", data_files=str(tmp_path / "hub.jsonl"), split=split, cache_dir=str(tmp_path / "cache")
        ),
    )
    by_name = _prepare(["hf:someone/corpus"], tmp_path / "tok_hub")
    assert np.array_equal(_stream(by_name), _stream(out))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(
        DataError, match=r"dict is a Hugging Face DatasetDict; pass one split's folder, e\.g\. .*dict/train"
    ):
        _prepare([tmp_path / "dict"], tmp_path / "tok2")


def _hf_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_text(i, 50) for i in range(20)], trainer)
    tok.save(str(path))
    return path


def _tiktoken_file(path: Path, pairs: bool = False) -> Path:
    """Every byte, a few merges (or every byte pair: 65,792 ranks, vocab > 65,536)."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes([a, b]) for a in range(256) for b in range(256)] if pairs else [b"al", b"pha", b"alpha", b" b"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


@pytest.mark.parametrize("kind", ["hf", "tiktoken", "tiktoken_large"])
def test_real_tokenizers_bos_eos_and_dtype(corpus: Path, tmp_path: Path, kind: str) -> None:
    spec = str(
        _hf_tokenizer(tmp_path / "tokenizer.json")
        if kind == "hf"
        else _tiktoken_file(tmp_path / "tokenizer.model", pairs=kind == "tiktoken_large")
    )
    tok = build_tokenizer(spec)
    out = _prepare([corpus / "sub" / "c.jsonl"], tmp_path / "tok", tokenizer=spec, workers=2, shard_mb=2 / 1024)
    index = read_index(out)
    assert index["dtype"] == ("uint32" if kind == "tiktoken_large" else "uint16")
    assert index["tokenizer"]["fingerprint"] == tok.fingerprint
    texts = [text for _, text in load_texts(f"path:{corpus / 'sub' / 'c.jsonl'}")]
    stream = _stream(out)
    assert np.array_equal(stream, [i for t in texts for i in tok.encode(t, bos=True, eos=True)])
    assert (
        (stream == tok.bos_id).sum()
        == (stream == tok.eos_id).sum()
        == len(texts)
        == index["splits"]["train"]["num_docs"]
    )
    batch = next(iter(build_dataloader(f"tokens:{out}", tok, 16, 2, 0, 1, seed=0)))
    assert batch[0].shape == (2, 16) and batch[0].dtype == torch.int64


# --- prepare: workers, machines, held-out split, crashes --------------------------------------


def test_same_bytes_for_1_and_4_workers(corpus: Path, tmp_path: Path) -> None:
    options = {"shard_mb": 3 / 1024, "validation_fraction": 0.2, "split_seed": 7}
    one = _files(_prepare([corpus], tmp_path / "one", workers=1, **options))
    four = _files(_prepare([corpus], tmp_path / "four", workers=4, **options))
    assert len(one) > 8 and one == four  # index.json included


def test_split_across_machines_then_merge(corpus: Path, tmp_path: Path) -> None:
    single = _files(_prepare([corpus], tmp_path / "single", shard_mb=3 / 1024))
    out = tmp_path / "multi"
    assert (
        prepare(PrepareConfig([str(corpus)], out, shard_mb=3 / 1024, num_shards=2, shard_index=1, progress=False))
        is None
    )
    with pytest.raises(DataError, match=r"partial index of --shard-index 0 of 2 is missing"):
        merge(out)
    with pytest.raises(DataError, match=r"multi: prepare did not finish"):
        build_dataloader(f"tokens:{out}", TOK, 8, 1, 0, 1, 0)
    _prepare([corpus], out, shard_mb=3 / 1024, num_shards=2, shard_index=0)
    merge(out)
    assert _files(out) == single


def test_validation_split_is_held_out_by_document(corpus: Path, tmp_path: Path) -> None:
    out = _prepare([corpus], tmp_path / "tok", validation_fraction=0.25, split_seed=1)
    index = read_index(out)
    train, held = index["splits"]["train"], index["splits"]["validation"]
    assert train["num_docs"] + held["num_docs"] == 62 and 5 <= held["num_docs"] <= 30
    docs = lambda stream: {tuple(d) for d in np.split(stream, np.flatnonzero(stream == TOK.bos_id)[1:])}  # noqa: E731
    assert not docs(_stream(out)) & docs(_stream(out, "validation"))
    assert sorted(_stream(out).tolist() + _stream(out, "validation").tolist()) == sorted(
        tokenize_corpus(load_texts(f"path:{corpus}"), TOK).tolist()
    )
    val = build_dataloader(f"tokens:{out}:validation", TOK, 8, 2, 0, 1, seed=0)
    assert set(next(iter(val))[0].flatten().tolist()) <= set(_stream(out, "validation").tolist())
    assert val.num_windows_per_epoch == held["num_tokens"] // 9
    with pytest.raises(DataError, match=r"index\.json has no 'validation' split \(has: train\)"):
        build_dataloader(f"tokens:{_prepare([corpus], tmp_path / 'plain')}:validation", TOK, 8, 1, 0, 1, 0)


def test_killed_prepare_is_detected_and_resumes(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = _files(_prepare([corpus], tmp_path / "clean", shard_mb=3 / 1024))
    out, real, calls = tmp_path / "tok", prepare_module.run_group, []

    def killed_during_third_group(job):
        calls.append(job["group"])
        if len(calls) == 3:
            (out / "train" / f"shard_{job['group']:06d}.bin.tmp").write_bytes(b"\x01\x02\x03")  # half-written
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(prepare_module, "run_group", killed_during_third_group)
    with pytest.raises(KeyboardInterrupt):
        _prepare([corpus], out, shard_mb=3 / 1024)
    assert not (out / "index.json").exists()
    for attempt in (lambda: build_dataloader(f"tokens:{out}", TOK, 8, 1, 0, 1, 0), lambda: verify(out)):
        with pytest.raises(DataError, match=r"tok: prepare did not finish \(no index\.json\); rerun"):
            attempt()
    # The rerun skips the two finished groups, redoes the third and yields the clean bytes.
    calls.clear()
    monkeypatch.setattr(prepare_module, "run_group", lambda job: calls.append(job["group"]) or real(job))
    _prepare([corpus], out, shard_mb=3 / 1024)
    assert calls[0] == 2 and 0 not in calls and 1 not in calls
    assert _files(out) == clean


def test_prepare_refuses_to_mix_or_clobber(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _prepare([corpus], tmp_path / "tok")
    with pytest.raises(DataError, match=r"tok is already prepared .*--overwrite"):
        _prepare([corpus], out)
    monkeypatch.setattr(prepare_module, "merge", lambda out: None)  # stop before index.json: unfinished
    _prepare([corpus], tmp_path / "half", validation_fraction=0.5)
    with pytest.raises(DataError, match=r"half holds an unfinished prepare of other inputs or options"):
        _prepare([corpus], tmp_path / "half")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"mine exists and is not a prepare output"):
        _prepare([corpus], tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").exists()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("data.csv", "a,b", r"data\.csv: unsupported input \(allowed: .txt, .md, .jsonl"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{oops\n', r"bad\.jsonl:3: not valid JSON"),
        (
            "field.jsonl",
            '{"text": "ok"}\n{"body": "x"}\n',
            r"field\.jsonl:2: expected a JSON object with a string 'text'",
        ),
        ("latin.txt", b"caf\xe9", r"latin\.txt is not valid UTF-8"),
        ("t.parquet", None, r"t\.parquet: no column 'text' \(has: body\); set --text-column"),
    ],
)
def test_bad_inputs_give_one_line_naming_the_file(tmp_path: Path, name: str, content, message: str) -> None:
    path = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["x"]}), path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DataError, match=message) as info:
        _prepare([path], tmp_path / "tok")
    assert "\n" not in str(info.value)


def test_cli_prepare_verify_and_errors(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "tok"
    assert cli_main(["prepare", str(corpus), "-o", str(out), "--workers", "2", "--no-progress"]) == 0
    assert f"tokens:{out}" in capsys.readouterr().out
    assert cli_main(["verify", str(out), "--no-progress"]) == 0
    assert "ok (train" in capsys.readouterr().out
    assert cli_main(["prepare", str(tmp_path / "nope"), "-o", str(tmp_path / "x"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: input {tmp_path / 'nope'} does not exist"]


def test_prepare_command_does_not_import_torch(corpus: Path, tmp_path: Path) -> None:
    # Its worker processes start faster and smaller without torch.
    code = (
        "import sys; from torchtitan_amp.data.cli import main; "
        f"rc = main(['prepare', {str(corpus)!r}, '-o', {str(tmp_path / 'tok')!r}, '--no-progress', '--workers', '2']); "
        "sys.exit(rc or ('torch' in sys.modules and 3))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# --- the loader: order, ranks, resume -------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_window_order_is_a_seeded_permutation(n: int) -> None:
    order = WindowOrder(n, seed=5, epoch=2)(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(order, WindowOrder(n, seed=5, epoch=3)(np.arange(n)))
        assert np.array_equal(order, WindowOrder(n, seed=5, epoch=2)(np.arange(n)))


@pytest.fixture
def numbered(tmp_path: Path) -> Path:
    """Every window of 17 tokens holds one whole 8-digit number: windows are told apart by content."""
    (tmp_path / "n.txt").write_text(" ".join(f"{i:08d}" for i in range(400)))
    return _prepare([tmp_path / "n.txt"], tmp_path / "tok", shard_mb=1 / 1024)


def test_dp_ranks_are_disjoint_and_cover_the_epoch(numbered: Path) -> None:
    stream = _stream(numbered)
    windows = {tuple(stream[i * 17 : i * 17 + 17]) for i in range(stream.size // 17)}
    ranks = 3
    seen = []
    for rank in range(ranks):
        loader = build_dataloader(f"tokens:{numbered}", TOK, 16, 4, rank, ranks, seed=0)
        m = loader.num_windows_per_epoch
        assert m == len(windows) // ranks
        rows = _epoch_rows(loader, -(-m // 4))[:m]
        assert len(set(rows)) == m and set(rows) <= windows
        seen.append(set(rows))
    assert len(set.union(*seen)) == ranks * m
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_is_exact(numbered: Path, num_workers: int) -> None:
    make = lambda: build_dataloader(f"tokens:{numbered}", TOK, 16, 8, 1, 2, seed=4, num_workers=num_workers)  # noqa: E731
    reference = build_dataloader(f"tokens:{numbered}", TOK, 16, 8, 1, 2, seed=4)
    assert reference.num_windows_per_epoch == 105  # 3601 tokens / 17 / 2 ranks: batch 13 straddles epochs
    it = iter(reference)
    want = [next(it) for _ in range(16)]
    first = make()
    it = iter(first)
    got = [next(it) for _ in range(9)]
    state = first.state_dict()
    assert set(state) == {"position", "world_size"} and state["position"]["samples"] == 9 * 8 * 2
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    got += [next(it) for _ in range(7)]
    for (a, b), (c, d) in zip(got, want, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert resumed.epoch == reference.epoch == 1


def test_loader_workers_need_a_tokens_dataset(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(_text(0, 50))
    with pytest.raises(DataError, match=r"num_workers > 0 needs a 'tokens:' dataset"):
        build_dataloader(f"path:{tmp_path / 'a.txt'}", TOK, 8, 1, 0, 1, 0, num_workers=2)
    with pytest.raises(ConfigError, match=r"'training.dataloader_num_workers' must be >= 0, got -1"):
        load_config(["--training.dataloader_num_workers", "-1"])


def _global_rows(loaders: list, n: int) -> list[set]:
    its = [iter(dl) for dl in loaders]
    return [{tuple(row.tolist()) for it in its for row in next(it)[0]} for _ in range(n)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_on_another_dp_degree_is_exact(numbered: Path, num_workers: int) -> None:
    # 211 windows; global batches of 24 straddle the epoch at batch 8; 4 ranks x 6 -> 2 ranks x 12.

    def make(r: int, n: int, b: int, w: int = 0) -> ParallelAwareDataLoader:
        return build_dataloader(f"tokens:{numbered}", TOK, 16, b, r, n, seed=4, num_workers=w)

    straight = _global_rows([make(r, 4, 6) for r in range(4)], 12)
    first = [make(r, 4, 6, num_workers) for r in range(4)]
    got = _global_rows(first, 7)
    state = first[0].state_dict()
    assert state["position"] == {"samples": 7 * 24, "epoch": 0, "windows": 211, "seed": 4, "samples_per_step": 24}
    resumed = [make(r, 2, 12, num_workers) for r in range(2)]
    for dl in resumed:
        dl.load_state_dict(state)
    got += _global_rows(resumed, 5)
    assert got == straight and all(len(b) == 24 for b in got)
    assert resumed[0].epoch == 1 and resumed[0].state_dict()["position"]["samples"] == 12 * 24


def test_state_from_another_batch_size_continues_from_its_sample(numbered: Path) -> None:
    loader = build_dataloader(f"tokens:{numbered}", TOK, 16, 5, 0, 1, seed=0)
    next(iter(loader))
    other = build_dataloader(f"tokens:{numbered}", TOK, 16, 4, 0, 1, seed=0)
    other.load_state_dict(loader.state_dict())
    assert other.resume_note == (
        "data resumes at sample 5 (epoch 0); global batch was 5 sequences, now 4: "
        "steps from here cut the sample stream differently from the straight run"
    )
    straight = next(iter(build_dataloader(f"tokens:{numbered}", TOK, 16, 9, 0, 1, seed=0)))[0]
    assert torch.equal(next(iter(other))[0], straight[5:])


# --- start-up checks and verify -------------------------------------------------------------


def _index_edit(folder: Path, edit) -> None:
    index = json.loads((folder / "index.json").read_text())
    edit(index)
    (folder / "index.json").write_text(json.dumps(index))


def _shard0(folder: Path) -> Path:
    return folder / read_index(folder)["splits"]["train"]["shards"][0]["file"]


def _break(case: str, folder: Path, tmp_path: Path):
    """Damages `folder` as `case` says; returns the tokenizer the job uses."""
    if case == "vocab":
        return build_tokenizer(str(_tiktoken_file(tmp_path / "t.model")))
    if case == "tokenizer":
        return SimpleNamespace(vocab_size=258, bos_id=256, eos_id=257, fingerprint="hf:0123456789abcdef")
    if case == "missing":
        _shard0(folder).unlink()
    elif case == "truncated":
        shard = _shard0(folder)
        shard.write_bytes(shard.read_bytes()[:-2])
    elif case == "id_in_index":
        _index_edit(folder, lambda i: i["splits"]["train"]["shards"][0].update(max_token_id=300))
    elif case == "not_prepared":
        (folder / "index.json").unlink()
    elif case == "foreign_format":
        _index_edit(folder, lambda i: i.update(format="megatron"))
    return TOK


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("vocab", r"tok/index\.json: tokens were made with vocab size 258 \(byte\), but this job's tokenizer has 516"),
        ("tokenizer", r"tok/index\.json: tokens were made with another tokenizer \(byte, byte:utf8-258"),
        ("missing", r"tok/train/shard_000000\.bin: shard listed in .*index\.json is missing"),
        ("truncated", r"tok/train/shard_000000\.bin: \d+ bytes, but .* says \d+ uint16 tokens \(truncated or replaced"),
        ("id_in_index", r"tok/train/shard_000000\.bin: token id 300 >= vocab size 258"),
        ("not_prepared", r"tok has no index\.json: not a folder written by"),
        ("foreign_format", r"tok/index\.json: format 'megatron' is not 'torchtitan_amp\.tokens/1'"),
    ],
)
def test_startup_checks_give_one_line_naming_the_file(numbered: Path, tmp_path: Path, case: str, message: str) -> None:
    tokenizer = _break(case, numbered, tmp_path)
    with pytest.raises(DataError, match=message) as info:
        build_dataloader(f"tokens:{numbered}", tokenizer, 16, 1, 0, 1, seed=0)
    assert "\n" not in str(info.value)


def test_verify_reads_what_startup_only_stats(numbered: Path, capsys: pytest.CaptureFixture) -> None:
    shard = _shard0(numbered)
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01  # same size: start-up cannot see it
    shard.write_bytes(bytes(data))
    build_dataloader(f"tokens:{numbered}", TOK, 16, 1, 0, 1, seed=0)
    assert cli_main(["verify", str(numbered), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shard_000000.bin: sha256" in err[0] and "does not match" in err[0]
    # An id beyond the vocabulary whose checksum is right (a foreign or buggy writer).
    data[10:12] = np.array([300], dtype="<u2").tobytes()
    shard.write_bytes(bytes(data))
    import hashlib

    _index_edit(numbered, lambda i: i["splits"]["train"]["shards"][0].update(sha256=hashlib.sha256(data).hexdigest()))
    with pytest.raises(DataError, match=r"shard_000000\.bin: token id 300 >= vocab size 258"):
        verify(numbered)


# --- the trainer ------------------------------------------------------------------------------


def test_trainer_resumes_bitwise_on_tokens_with_loader_workers(
    numbered: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
    args = [
        "--model.flavor",
        "debugmodel_h64",
        "--training.dataset",
        f"tokens:{numbered}",
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "4",
        "--training.dataloader_num_workers",
        "2",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "1",
        "--mixed_precision.enabled",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    trainer_module.Trainer(load_config(args + ["--job.dump_folder", str(a)])).train()
    shutil.copytree(a / "checkpoint" / "step-2", b / "checkpoint" / "step-2")
    trainer_module.Trainer(load_config(args + ["--job.dump_folder", str(b)])).train()
    read = lambda d: {r["step"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}  # noqa: E731
    got, want = read(b), read(a)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"])
