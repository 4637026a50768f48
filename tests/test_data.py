import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchtitan_amp import data
from torchtitan_amp.data import (
    DataError,
    PackedTextDataset,
    ParallelAwareDataLoader,
    build_dataloader,
    load_texts,
    tokenize_corpus,
)
from torchtitan_amp.data.tokenizer import ByteTokenizer

Batch = tuple[torch.Tensor, torch.Tensor]
TOK = ByteTokenizer()


def _take(it: Iterator[Batch], n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for (ai, al), (bi, bl) in zip(a, b):
        assert torch.equal(ai, bi) and torch.equal(al, bl)


def _pydoc_loader(seed: int = 0, dp_rank: int = 0, dp_world_size: int = 1, batch: int = 4) -> ParallelAwareDataLoader:
    return build_dataloader(
        "pydoc", TOK, seq_len=64, local_batch_size=batch, dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed
    )


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> str:
    # 58 bytes + BOS/EOS = 60 tokens = 12 windows of seq_len 4: epochs end every few batches.
    path = tmp_path / "tiny.txt"
    path.write_text("the quick brown fox jumps over the lazy dog, twice or more.")
    return f"path:{path}"


def _tiny_loader(dataset: str, seed: int = 0, batch: int = 5) -> ParallelAwareDataLoader:
    return build_dataloader(dataset, TOK, seq_len=4, local_batch_size=batch, dp_rank=0, dp_world_size=1, seed=seed)


def test_building_a_loader_warns_nothing(tiny_corpus: str) -> None:
    # torchdata's constructor calls torch.set_vital, deprecated with a warning since torch 2.13.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _tiny_loader(tiny_corpus)


# --- corpora -------------------------------------------------------------------------------


def test_pydoc_dataset_is_nontrivial_and_sorted() -> None:
    docs = load_texts("pydoc")
    assert len(docs) > 50
    assert sum(len(text) for _, text in docs) > 100_000
    names = [name for name, _ in docs]
    assert names == sorted(names) and all(name.startswith("pydoc:") for name in names)


def test_path_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b" / "c.md").write_text("# gamma")
    (tmp_path / "b" / "d.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    (tmp_path / "ignored.py").write_text("print('not data')")
    (tmp_path / "empty.txt").write_text("")

    assert load_texts(f"path:{tmp_path / 'a.txt'}") == [(str(tmp_path / "a.txt"), "alpha")]
    assert [text for _, text in load_texts(f"path:{tmp_path}")] == ["alpha", "# gamma", "one", "two"]
    assert load_texts(f"path:{tmp_path / 'b' / 'd.jsonl'}")[1][0].endswith("d.jsonl:3")


def test_tokenize_corpus_concatenates_with_bos_eos() -> None:
    tokens = tokenize_corpus([("a", "hi"), ("b", "é")], TOK)
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == [256, 104, 105, 257, 256, 0xC3, 0xA9, 257]


def test_corpus_is_tokenised_once_per_dataset_and_tokenizer(tiny_corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = data.text.tokenize_corpus
    monkeypatch.setattr(data.text, "tokenize_corpus", lambda docs, tok: calls.append(1) or real(docs, tok))
    for rank in range(2):
        build_dataloader(tiny_corpus, ByteTokenizer(), 4, 1, dp_rank=rank, dp_world_size=2, seed=0)
    assert len(calls) == 1


# --- errors --------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does_not_exist.txt does not exist"):
        load_texts(f"path:{tmp_path / 'does_not_exist.txt'}")


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.py").write_text("x = 1")
    with pytest.raises(DataError, match="no .txt, .md or .jsonl files"):
        load_texts(f"path:{tmp_path}")


def test_only_empty_documents(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no non-empty documents"):
        load_texts(f"path:{tmp_path}")


def test_unsupported_file_type(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"data\.csv: unsupported file type.*allowed: .txt, .md, .jsonl"):
        load_texts(f"path:{tmp_path / 'data.csv'}")


def test_non_utf8_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not valid UTF-8"):
        load_texts(f"path:{tmp_path}")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{oops", "not valid JSON"),
        ('{"content": "x"}', "string 'text' field"),
        ('{"text": 3}', "string 'text' field"),
        ('["text"]', "string 'text' field"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"docs\.jsonl:2: .*{reason}"):
        load_texts(f"path:{path}")


def test_unknown_spec_lists_allowed_forms() -> None:
    with pytest.raises(DataError, match=r"unknown dataset 'c4'.*'pydoc', 'path:.*'tokens:"):
        load_texts("c4")


def test_too_few_tokens(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("abc")  # 5 tokens with BOS/EOS
    with pytest.raises(DataError, match=r"corpus has 5 tokens but needs at least 18 \(dp_world_size 2"):
        build_dataloader(f"path:{path}", TOK, seq_len=8, local_batch_size=1, dp_rank=0, dp_world_size=2, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seq_len": 0}, "seq_len"),
        ({"dp_rank": 2}, "dp_rank"),
        ({"local_batch_size": 0}, "local_batch_size"),
    ],
)
def test_bad_loader_arguments(tiny_corpus: str, kwargs: dict[str, int], field: str) -> None:
    args = {"seq_len": 4, "local_batch_size": 1, "dp_rank": 0, "dp_world_size": 2, "seed": 0} | kwargs
    with pytest.raises(DataError, match=field):
        build_dataloader(tiny_corpus, TOK, **args)


# --- packing, sharding, determinism ---------------------------------------------------------


def test_batches_are_shifted_windows() -> None:
    inputs, labels = next(iter(_pydoc_loader(batch=3)))
    assert inputs.shape == labels.shape == (3, 64)
    assert inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_windows_are_contiguous_and_non_overlapping() -> None:
    # With tokens 0..N-1 every window is identified by its first token.
    dataset = PackedTextDataset(torch.arange(103, dtype=torch.int32), seq_len=9, dp_rank=0, dp_world_size=1, seed=0)
    firsts = []
    for inputs, labels in _take(iter(dataset), dataset.num_windows_per_epoch):
        assert torch.equal(inputs, torch.arange(int(inputs[0]), int(inputs[0]) + 9))
        assert torch.equal(labels, inputs + 1)
        firsts.append(int(inputs[0]))
    assert sorted(firsts) == list(range(0, 100, 10))


def test_same_seed_is_deterministic_and_seeds_differ() -> None:
    _assert_batches_equal(_take(iter(_pydoc_loader(seed=1)), 3), _take(iter(_pydoc_loader(seed=1)), 3))
    assert not torch.equal(next(iter(_pydoc_loader(seed=1)))[0], next(iter(_pydoc_loader(seed=2)))[0])


def test_ranks_get_disjoint_windows_and_equal_counts() -> None:
    tokens = torch.arange(10 * 7 + 3, dtype=torch.int32)  # 10 windows of 7 tokens; 2 ranks x 3 leave 4 over
    per_rank = []
    for rank in range(3):
        dataset = PackedTextDataset(tokens, seq_len=6, dp_rank=rank, dp_world_size=3, seed=0)
        assert dataset.num_windows_per_epoch == 3
        per_rank.append({int(x[0]) for x, _ in _take(iter(dataset), 3)})
    assert all(len(s) == 3 for s in per_rank)
    assert len(set.union(*per_rank)) == 9

    loaders = [_pydoc_loader(dp_rank=r, dp_world_size=2) for r in range(2)]
    assert loaders[0].num_windows_per_epoch == loaders[1].num_windows_per_epoch > 1000
    rows = [{tuple(row.tolist()) for b in _take(iter(dl), 10) for row in b[0]} for dl in loaders]
    assert len(rows[0]) == len(rows[1]) == 40 and not rows[0] & rows[1]


def test_epoch_increments_and_reshuffles(tiny_corpus: str) -> None:
    dl = _tiny_loader(tiny_corpus, batch=1)
    assert dl.num_windows_per_epoch == 12 and dl.epoch == 0
    it = iter(dl)
    first = [int(x[0, 0]) for x, _ in _take(it, 12)]
    assert dl.epoch == 0
    second = [int(x[0, 0]) for x, _ in _take(it, 12)]
    assert dl.epoch == 1
    _take(it, 1)
    assert dl.epoch == 2
    assert sorted(first) == sorted(second) and first != second


# --- checkpointing -------------------------------------------------------------------------


def test_resume_mid_epoch_matches_uninterrupted_run() -> None:
    reference = _take(iter(_pydoc_loader()), 6)
    dl = _pydoc_loader()
    it = iter(dl)
    _take(it, 3)
    state = dl.state_dict()
    # Resume must come from the global position, not from replaying batches.
    assert state["position"]["samples"] == 12 and state["position"]["epoch"] == 0
    resumed = _pydoc_loader()
    resumed.load_state_dict(state)
    _assert_batches_equal(_take(iter(resumed), 3), reference[3:])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_resume_across_epoch_boundary(tiny_corpus: str, k: int) -> None:
    # 12 windows per epoch, 5 per batch: batches 3, 5, ... straddle epochs.
    uninterrupted = _tiny_loader(tiny_corpus)
    reference = _take(iter(uninterrupted), k + 4)
    dl = _tiny_loader(tiny_corpus)
    _take(iter(dl), k)
    resumed = _tiny_loader(tiny_corpus)
    resumed.load_state_dict(dl.state_dict())
    _assert_batches_equal(_take(iter(resumed), 4), reference[k:])
    assert resumed.epoch == uninterrupted.epoch


def test_state_before_iterating_starts_from_scratch(tiny_corpus: str) -> None:
    fresh = _tiny_loader(tiny_corpus)
    resumed = _tiny_loader(tiny_corpus)
    resumed.load_state_dict(fresh.state_dict())
    _assert_batches_equal(_take(iter(resumed), 3), _take(iter(_tiny_loader(tiny_corpus)), 3))


def test_empty_state_is_ignored(tiny_corpus: str) -> None:
    dl = _tiny_loader(tiny_corpus)
    dl.load_state_dict({})
    _assert_batches_equal(_take(iter(dl), 2), _take(iter(_tiny_loader(tiny_corpus)), 2))


def _rows(batches: list[Batch]) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for inputs, _ in batches for row in inputs]


def _global_batches(loaders: list[ParallelAwareDataLoader], n: int) -> list[set[tuple[int, ...]]]:
    """The windows of each of n global batches: the union of every rank's batch."""
    its = [iter(dl) for dl in loaders]
    return [set().union(*(_rows([next(it)]) for it in its)) for _ in range(n)]


@pytest.mark.parametrize(("ranks", "batch", "to_ranks", "to_batch"), [(4, 2, 2, 4), (2, 4, 1, 8), (3, 1, 1, 3)])
def test_resume_on_another_dp_degree_continues_the_global_batches(
    tiny_corpus: str, ranks: int, batch: int, to_ranks: int, to_batch: int
) -> None:
    # 12 windows: global batches of 8 (or 3) straddle epochs, and 12 mod 8 windows are not dropped.
    make = lambda r, n, b: build_dataloader(tiny_corpus, TOK, 4, b, r, n, seed=3)  # noqa: E731
    straight = _global_batches([make(r, ranks, batch) for r in range(ranks)], 7)
    first = [make(r, ranks, batch) for r in range(ranks)]
    got = _global_batches(first, 3)
    states = [dl.state_dict() for dl in first]
    assert all(s == states[0] for s in states) and states[0]["position"]["samples"] == 3 * ranks * batch
    resumed = [make(r, to_ranks, to_batch) for r in range(to_ranks)]
    for dl in resumed:
        dl.load_state_dict(states[0])
    assert f"saved on {ranks} data-parallel ranks, now {to_ranks}" in resumed[0].resume_note
    assert "global batch" not in resumed[0].resume_note
    got += _global_batches(resumed, 4)
    assert got == straight
    assert all(len(b) == ranks * batch for b in got[:1])


def test_another_global_batch_continues_from_the_same_sample(tiny_corpus: str) -> None:
    make = lambda b: build_dataloader(tiny_corpus, TOK, 4, b, 0, 1, seed=3)  # noqa: E731
    straight = _rows(_take(iter(make(1)), 20))
    first = make(5)
    _take(iter(first), 2)
    resumed = make(3)
    resumed.load_state_dict(first.state_dict())
    assert "global batch was 5 sequences, now 3" in resumed.resume_note and "\n" not in resumed.resume_note
    assert _rows(_take(iter(resumed), 3)) == straight[10:19]


def test_a_state_without_the_global_position_is_refused_in_one_line() -> None:
    with pytest.raises(
        DataError,
        match=r"^dataloader state needs a 'position' \(the global data position\), "
        r"got keys \['dp_rank_0', 'world_size'\]$",
    ):
        _pydoc_loader(dp_rank=0, dp_world_size=1).load_state_dict({"dp_rank_0": {}, "world_size": 2})


def test_state_of_another_dataset_is_refused(tiny_corpus: str) -> None:
    state = _pydoc_loader().state_dict()
    with pytest.raises(DataError, match=r"saved over 7173 windows but this run's dataset has 12"):
        _tiny_loader(tiny_corpus).load_state_dict(state)


def test_path_spec_without_path_is_unknown() -> None:
    with pytest.raises(DataError, match="unknown dataset 'path:'"):
        load_texts("path:")
