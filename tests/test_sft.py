"""Supervised fine-tuning on chat data (`chat:FILE`, torchtitan_amp/data/chat.py): the template renders
and tokenises as transformers' apply_chat_template, only assistant tokens are trained, packed
examples do not attend to each other, truncation says what it cut, bad input is one error line,
and a debug model started from a checkpoint learns the bundled conversations."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.hf import HFExport
from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data.chat import ChatWindows, chat_windows, encode_chat, example_tokens, load_conversations, pack
from torchtitan_amp.data.chat_template import ChatTemplate, template_for
from torchtitan_amp.data.loader import build_dataloader
from torchtitan_amp.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS
from torchtitan_amp.models.loss import IGNORE_INDEX
from torchtitan_amp.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "torchtitan_amp" / "data" / "bundled"
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKED = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "Reverse the word stone."},
    {"role": "assistant", "content": "stone reversed is enots."},
]
TINY = [
    "--model.flavor",
    "debugmodel_tiny",
    "--model.attn_mask_type",
    "block_causal",
    "--mixed_precision.enabled",
    "false",
    "--training.seed",
    "0",
    "--training.dataset",
    f"chat:{BUNDLED / 'chat_train.jsonl'}",
]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU's matmul benchmark is not what these tests are about."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _tokenizer_folder(folder: Path, template: str | None) -> Path:
    """A tiny byte-level BPE tokenizer folder with ChatML specials and `template` (None: no chat template)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant"] * 20
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        **({"chat_template": template} if template is not None else {}),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _hf_ids(result: Any) -> list[int]:
    return list(result["input_ids"] if hasattr(result, "keys") else result)


@pytest.mark.parametrize("template", [CHATML, CHATML_MARKED], ids=["prefixes", "generation_markers"])
def test_render_and_ids_equal_transformers_apply_chat_template(tmp_path: Path, template: str) -> None:
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(tmp_path / "tok", template)
    ours, theirs = build_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    chat = template_for(ours)
    for messages, prompt in ((CONVERSATION, False), (CONVERSATION[:2], True)):
        text = chat.render(messages, add_generation_prompt=prompt)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        hf = _hf_ids(theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt))
        assert encode_chat(text, ours)[0] == hf
    ids, trained = example_tokens(CONVERSATION, chat, ours)
    assert ids == _hf_ids(theirs.apply_chat_template(CONVERSATION, tokenize=True))
    # The trained tokens are exactly the assistant turns (content and end of turn).
    turns = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    expected = "".join(t + "<|im_end|>" + ("" if template is CHATML_MARKED else "\n") for t in turns)
    assert ours._tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False) == expected
    if template is CHATML_MARKED:
        hf_mask = theirs.apply_chat_template(
            CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )["assistant_masks"]
        assert [bool(m) for m in hf_mask] == trained


@pytest.mark.parametrize("choice", ["chatml", "jinja_file"])
def test_training_chat_template_adds_or_overrides_the_folders(tmp_path: Path, choice: str) -> None:
    """training.chat_template: a shipped name ("chatml") for a folder that ships no template, or a
    .jinja file overriding the folder's own: text and ids equal transformers' apply_chat_template
    given the same template, and the trained tokens are the assistant turns."""
    from transformers import AutoTokenizer

    from torchtitan_amp.data.chat_template import NAMED_TEMPLATES

    if choice == "chatml":
        folder, source, marked = _tokenizer_folder(tmp_path / "tok", None), NAMED_TEMPLATES["chatml"], False
        with pytest.raises(DataError, match="has no chat template .* training.chat_template"):
            template_for(build_tokenizer(str(folder)))
        setting = "chatml"
    else:
        own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        folder, source, marked = _tokenizer_folder(tmp_path / "tok", own), CHATML_MARKED, True
        (tmp_path / "mine.jinja").write_text(source)
        setting = str(tmp_path / "mine.jinja")
    ours, theirs = build_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    ours.chat_template = setting  # type: ignore[union-attr]  # what train/job.py sets from the config
    chat = template_for(ours)
    for messages, prompt in ((CONVERSATION, False), (CONVERSATION[:2], True)):
        kwargs = {"chat_template": source, "add_generation_prompt": prompt}
        text = chat.render(messages, add_generation_prompt=prompt)
        assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        assert encode_chat(text, ours)[0] == _hf_ids(theirs.apply_chat_template(messages, tokenize=True, **kwargs))
    ids, trained = example_tokens(CONVERSATION, chat, ours)
    hf_ids = _hf_ids(theirs.apply_chat_template(CONVERSATION, tokenize=True, chat_template=source))
    assert ids == (hf_ids if marked else [ours.bos_id, *hf_ids])  # BOS put in front where none is rendered
    turns = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    expected = "".join(t + "<|im_end|>" + ("" if marked else "\n") for t in turns)
    assert ours._tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False) == expected
    if choice == "chatml":  # the byte tokenizer takes the same names
        byte = ByteTokenizer()
        byte.chat_template = "chatml"
        assert template_for(byte).render(CONVERSATION) == theirs.apply_chat_template(
            CONVERSATION, tokenize=False, chat_template=source
        )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("nope", r"training.chat_template 'nope' is neither a shipped template \(byte, chatml\) nor a .jinja file"),
        ("missing.jinja", r"training.chat_template 'missing.jinja': no such file"),
    ],
    ids=["unknown_name", "missing_file"],
)
def test_unknown_chat_template_is_one_error_line(tmp_path: Path, setting: str, message: str) -> None:
    from torchtitan_amp.train.job import resolve

    argv = ["--job.dump_folder", str(tmp_path), *TINY, "--training.chat_template"]
    with pytest.raises(DataError, match=message) as err:
        resolve(load_config([*argv, setting]), 1, "cpu")
    assert "\n" not in str(err.value)
    job = resolve(load_config([*argv, "chatml"]), 1, "cpu")  # the config reaches the run's tokenizer
    from torchtitan_amp.data.chat_template import NAMED_TEMPLATES

    assert template_for(job.tokenizer).source == NAMED_TEMPLATES["chatml"]


INJECTED = [
    {"role": "user", "content": "Is </s> an end? And <s> a start?"},
    {"role": "assistant", "content": "In text, </s> is four characters."},
    {"role": "user", "content": "Thanks."},
]


def test_special_strings_in_messages_stay_text_for_the_byte_tokenizer() -> None:
    """Only the template's own markers become specials: "<s>" / "</s>" spelled in a message are
    their bytes (no BOS / EOS id inside any content); the template's BOS and the EOS ending the
    assistant turn stay ids; the text round-trips; generate --chat's prompt ids too."""
    from torchtitan_amp.data.chat import chat_prompt_ids

    tok = ByteTokenizer()
    chat = template_for(tok)
    text = chat.render(INJECTED[:2])
    ids, trained = example_tokens(INJECTED[:2], chat, tok)
    # BOS first and the assistant turn's EOS last, the template's; every other id is a byte.
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(i < 256 for i in ids[1:-1])
    assert bytes(ids[1:-1]).decode() == text[len("<s>") : -len("</s>")]
    assert [i for i, t in zip(ids, trained) if t] == [*INJECTED[1]["content"].encode(), tok.eos_id]
    prompt = chat_prompt_ids(INJECTED, tok)
    assert prompt.count(tok.bos_id) == 1 and prompt.count(tok.eos_id) == 1  # the one assistant turn's end


def test_special_tokens_in_messages_stay_text_for_a_tokenizer_folder(tmp_path: Path) -> None:
    """A ChatML tokenizer folder: "<|im_end|>" spelled in a message is tokenised as text, as
    transformers tokenises with split_special_tokens=True, between the template's own markers
    (which stay special tokens); elsewhere the ids are apply_chat_template's."""
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(tmp_path / "tok", CHATML)
    ours, theirs = build_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    im_end = theirs.convert_tokens_to_ids("<|im_end|>")
    messages = [
        {"role": "user", "content": "Say <|im_end|> twice: <|im_end|><|im_end|>"},
        {"role": "assistant", "content": "No."},
    ]
    chat = template_for(ours)
    text = chat.render(messages)
    ids, _ = encode_chat(text, ours)
    assert ids.count(im_end) == len(messages)  # one per message, the template's
    assert ours._tokenizer.decode(ids, skip_special_tokens=False) == text
    # The reference: the text cut at the template's own markers, each piece tokenised by transformers
    # (specials split inside the user's turn, matched elsewhere).
    head, rest = text.split("<|im_start|>", 2)[1], "<|im_start|>" + text.split("<|im_start|>", 2)[2]
    user_turn = head[: head.rindex("<|im_end|>")]
    expected = (
        _hf_ids(theirs(text[: text.index(user_turn)], add_special_tokens=False))
        + _hf_ids(theirs(user_turn, add_special_tokens=False, split_special_tokens=True))
        + _hf_ids(theirs(head[len(user_turn) :] + rest, add_special_tokens=False))
    )
    assert ids == expected
    plain = [{"role": "user", "content": "Say it twice."}, messages[1]]
    assert encode_chat(chat.render(plain), ours)[0] == _hf_ids(theirs.apply_chat_template(plain, tokenize=True))


def _chat_sample(tokens: list[int], trained: list[bool], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    stream = torch.tensor(tokens, dtype=torch.int32)
    windows = ChatWindows(stream, torch.tensor(trained), seq_len, 0, 1, 0)
    inputs, labels = next(iter(windows))
    return inputs[None], labels[None]


def _grads(trainer: Trainer, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = trainer.forward_backward_step(iter([batch]))
    return loss.detach().clone(), [p.grad.clone() for p in trainer.run.model.parameters() if p.grad is not None]


def test_prompt_tokens_never_reach_the_loss(tmp_path: Path) -> None:
    """A window's labels come from its tokens: changing a prompt token among the targets (inputs
    held) leaves the trainer's loss and every gradient bitwise equal; changing an assistant token
    changes them. Fails if any prompt token is a valid label."""
    tok = ByteTokenizer()
    ids, trained = example_tokens(CONVERSATION, template_for(tok), tok)
    seq_len = len(ids) - 1
    base_inputs, base_labels = _chat_sample(ids, trained, seq_len)
    trainer = Trainer(
        load_config(
            [
                "--job.dump_folder",
                str(tmp_path),
                *TINY,
                "--training.seq_len",
                str(seq_len),
                "--training.local_batch_size",
                "1",
            ]
        )
    )
    base_loss, base_grads = _grads(trainer, (base_inputs, base_labels))
    prompt_positions = [j for j in range(1, len(ids)) if not trained[j]]
    assistant_positions = [j for j in range(1, len(ids)) if trained[j]]
    assert prompt_positions and assistant_positions
    # Every prompt target at once (one step: cheap); any of them counted would change the loss.
    changed = [(t + 1) % 256 if j in prompt_positions else t for j, t in enumerate(ids)]
    _, labels = _chat_sample(changed, trained, seq_len)
    loss, grads = _grads(trainer, (base_inputs, labels))
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    changed = list(ids)
    changed[assistant_positions[0]] = (ids[assistant_positions[0]] + 1) % 256
    _, labels = _chat_sample(changed, trained, seq_len)
    loss, grads = _grads(trainer, (base_inputs, labels))
    assert not torch.equal(loss, base_loss)
    assert not all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    assert (base_labels != IGNORE_INDEX).sum() == sum(trained[1:])


def test_packed_examples_do_not_attend_to_each_other(tmp_path: Path) -> None:
    """Two conversations packed in one window (the second's turns end with EOS inside it): changing
    the first's assistant answer leaves the second's logits bitwise equal under block_causal on
    chat data, and the first's own logits after the change do differ."""
    tok = ByteTokenizer()
    chat = template_for(tok)
    first = example_tokens(CONVERSATION[:3], chat, tok)
    second = example_tokens(CONVERSATION, chat, tok)
    # Same length (the same rotary positions for the second), other tokens.
    other = example_tokens(
        [CONVERSATION[0], CONVERSATION[1], {"role": "assistant", "content": "2 + 3 = 6."}], chat, tok
    )
    assert len(other[0]) == len(first[0]) and other[0] != first[0]
    window = len(first[0]) + len(second[0])
    trainer = Trainer(
        load_config(
            [
                "--job.dump_folder",
                str(tmp_path),
                *TINY,
                "--training.seq_len",
                str(window),
                "--training.local_batch_size",
                "1",
            ]
        )
    )
    model, mask_inputs = trainer.run.model, trainer.run.job.mask_inputs
    logits = []
    for one in (first, other):
        stream, _, _ = pack([("a", *one), ("b", *second)], len(one[0]) + len(second[0]), tok.eos_id)
        tokens = stream[None].long()
        with torch.no_grad():
            out = model(tokens, **mask_inputs(tokens))
        logits.append(out[0])
    split = len(first[0])
    assert torch.equal(logits[0][split:], logits[1][split:])
    assert not torch.equal(logits[0][:split], logits[1][:split])


def test_truncation_reports_what_it_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "chat.jsonl"
    long = {"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y" * 40}]}
    short = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text("\n".join(json.dumps(c) for c in (short, long, short)) + "\n")
    tok = ByteTokenizer()
    full = len(example_tokens(long["messages"], template_for(tok), tok)[0])
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        tokens, trained = chat_windows(f"chat:{path}", tok, 63)
    assert tokens.numel() % 64 == 0 and not trained.all()
    cut = [r.getMessage() for r in caplog.records if "truncation cut" in r.getMessage()]
    assert cut == [
        f"chat data {path}: truncation cut 1 examples longer than 64 tokens ({full - 64} tokens dropped; "
        f"{path}:2); raise training.seq_len to keep them"
    ]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return f"chat:{path}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"chat dataset .*chat.jsonl is empty \(no conversations\)"),
        ('{"messages": []}\nnot json\n', r"chat.jsonl:2: not valid JSON"),
        ('{"messages": [{"content": "hi"}]}\n', r"chat.jsonl:1: message 0 has no 'role'"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}\n', r"chat.jsonl:1: message 0 has role 'bot', not one of"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"chat.jsonl:1: no assistant message"),
    ],
    ids=["empty", "not_json", "no_role", "unknown_role", "no_assistant"],
)
def test_bad_chat_files_are_one_error_line(tmp_path: Path, text: str, message: str) -> None:
    if text.startswith('{"messages": []}'):
        text = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\nnot json\n'
    spec = _write(tmp_path / "chat.jsonl", text)
    with pytest.raises(DataError, match=message) as err:
        build_dataloader(spec, ByteTokenizer(), 32, 1, 0, 1, 0)
    assert "\n" not in str(err.value)


def test_template_rendering_no_assistant_turn_is_one_error_line(tmp_path: Path) -> None:
    folder = _tokenizer_folder(
        tmp_path / "tok",
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}",
    )
    spec = _write(tmp_path / "chat.jsonl", json.dumps({"messages": CONVERSATION[1:3]}) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:1: the chat template .* renders no assistant turn") as err:
        build_dataloader(spec, build_tokenizer(str(folder)), 32, 1, 0, 1, 0)
    assert "\n" not in str(err.value)


def test_bundled_data_loads_and_holds_out_validation() -> None:
    train = load_conversations(BUNDLED / "chat_train.jsonl")
    val = load_conversations(BUNDLED / "chat_val.jsonl")
    assert len(train) >= 300 and len(val) >= 30
    assert sum(p.stat().st_size for p in BUNDLED.glob("*.jsonl")) < 1_000_000
    assert isinstance(template_for(ByteTokenizer()), ChatTemplate)


SFT_ARGS = [*TINY, "--training.seq_len", "128", "--training.local_batch_size", "4", "--optimizer.lr", "3e-3"]


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A seed checkpoint of the debug model (training.seed 0): its step folder and its weights."""
    seed_dump = tmp_path_factory.mktemp("seed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
        seeded = Trainer(
            load_config(["--job.dump_folder", str(seed_dump), *SFT_ARGS, "--checkpoint.create_seed_checkpoint"])
        )
        seeded.train()
    start = {k: v.detach().clone() for k, v in seeded.run.model.state_dict().items()}
    return seed_dump / "checkpoint" / "step-0", start


def test_initial_load_path_loads_with_checkpointing_disabled(
    tmp_path: Path, seed_checkpoint: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    """checkpoint.enable governs saving and resuming; checkpoint.initial_load_path is loaded either
    way: with enable = false the run starts from those weights (bitwise), not from its own init,
    and writes no checkpoint."""
    step0, start = seed_checkpoint
    dump = tmp_path / "sft"
    trainer = Trainer(
        load_config(
            [
                "--job.dump_folder",
                str(dump),
                *SFT_ARGS,
                "--training.seed",
                "1",  # another init: the checkpoint's weights must replace it
                "--checkpoint.enable",
                "false",
                "--checkpoint.initial_load_path",
                str(step0),
            ]
        )
    )
    state = trainer.run.model.state_dict()
    assert state.keys() == start.keys()
    assert all(torch.equal(v, start[k]) for k, v in state.items())
    assert trainer.run.resumed is not None and trainer.run.resumed.step == 0
    assert not (dump / "checkpoint").exists()


def test_finetune_from_a_checkpoint_lowers_the_assistant_loss(
    tmp_path: Path, seed_checkpoint: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    """A seed checkpoint of the debug model is the starting point (checkpoint.initial_load_path);
    fine-tuning on the bundled conversations lowers the loss on assistant tokens."""
    step0, start = seed_checkpoint
    args = SFT_ARGS
    trainer = Trainer(
        load_config(
            [
                "--job.dump_folder",
                str(tmp_path / "sft"),
                *args,
                "--training.seed",
                "1",  # another init: the checkpoint's weights must replace it
                "--checkpoint.enable",
                "--checkpoint.interval",
                "1000",
                "--checkpoint.initial_load_path",
                str(step0),
                "--lr_scheduler.warmup_steps",
                "2",
            ]
        )
    )
    assert all(torch.equal(v, start[k]) for k, v in trainer.run.model.state_dict().items())
    batches = trainer.new_batches()
    losses = [float(trainer.train_step(batches)[0]) for _ in range(12)]
    assert sum(losses[-3:]) / 3 < 0.75 * sum(losses[:3]) / 3, losses


def _tiny_hf_config() -> Any:
    """transformers' LlamaConfig of debugmodel_tiny with the byte tokenizer's vocabulary (as our
    export writes it): the HF folder an SFT run starts from."""
    from transformers import LlamaConfig

    from torchtitan_amp.checkpoint.hf import hf_config

    tok = ByteTokenizer()
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel_tiny"], vocab_size=tok.vocab_size)
    return LlamaConfig.from_dict(hf_config(args, "float32", tok.bos_id, tok.eos_id))


# One conversation as training sees it (BOS first): the tokens both models' logits are compared on.
HF_TOKENS = torch.tensor([example_tokens(CONVERSATION[:3], template_for(ByteTokenizer()), ByteTokenizer())[0]])
HF_EXPORT = HFExport("LlamaForCausalLM", _tiny_hf_config, HF_TOKENS, max_shard_size="200KB")  # conftest's `hf`
# fp32 logits of the same weights in transformers' LlamaForCausalLM and ours: the two differ only
# in the order of fp32 operations (rotary as rotate_half vs interleaved pairs on permuted rows,
# eager vs SDPA attention, norm and softmax reductions), each a few units of 2**-24 relative to
# values of order one, accumulated over 4 layers and sums of at most 256 terms:
# 4 x sqrt(256) x 2**-24 = 64 units of 2**-24, times max|logit|. Measured: 1.8e-7 at max|logit| 0.56
# (bound 2.1e-6); the 3 steps moved the logits by 0.14.
HF_LOGITS_RTOL = 64 * 2.0**-24


def test_sft_from_a_hugging_face_folder_exports_to_transformers_with_our_logits(
    hf: tuple[Path, Any, torch.Tensor], tmp_path: Path
) -> None:
    """SFT end to end: start from a Hugging Face Llama folder (checkpoint.initial_load_path),
    fine-tune 3 steps on the bundled conversations, export at the last step
    (checkpoint.last_save_hf, fp32); transformers loads the export with no missing or unexpected
    keys and gives our fine-tuned model's logits; the fine-tune moved them away from the start."""
    from transformers import LlamaForCausalLM

    folder, _, start_logits = hf
    dump = tmp_path / "sft"
    trainer = Trainer(
        load_config(
            [
                "--job.dump_folder",
                str(dump),
                *SFT_ARGS,
                "--training.steps",
                "3",
                "--checkpoint.initial_load_path",
                str(folder),
                "--checkpoint.enable",
                "--checkpoint.interval",
                "1000",
                "--checkpoint.last_save_hf",
            ]
        )
    )
    trainer.train()
    model, info = LlamaForCausalLM.from_pretrained(dump / "checkpoint" / "hf-step-3", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours_model = trainer.run.model.eval()
    with torch.no_grad():
        theirs = model.eval()(HF_TOKENS).logits
        ours = ours_model(HF_TOKENS, **trainer.run.job.mask_inputs(HF_TOKENS))
    bound = HF_LOGITS_RTOL * float(ours.abs().max())
    assert (theirs - ours).abs().max() <= bound
    assert (start_logits - ours).abs().max() > 1000 * bound  # trained: not the import compared to itself


def test_causal_packing_of_chat_data_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Packed conversations under model.attn_mask_type = 'causal' see the ones before them in their
    window: one warning naming the fields (training and validation data both chat: still one);
    none under block_causal."""
    from torchtitan_amp.train.build import build_loaders, resolve_process_and_job

    def warnings(mask: str) -> list[str]:
        config = load_config(
            [
                "--job.dump_folder",
                str(tmp_path),
                *TINY,
                "--model.attn_mask_type",
                mask,
                "--training.seq_len",
                "128",
                "--validation.enable",
                "--validation.dataset",
                f"chat:{BUNDLED / 'chat_val.jsonl'}",
            ]
        )
        info, job = resolve_process_and_job(config)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchtitan_amp"):
            build_loaders(config, job, info)
        return [r.getMessage() for r in caplog.records if "attn_mask_type" in r.getMessage()]

    assert warnings("causal") == [
        "chat data (training.dataset, validation.dataset) packs several conversations into a window and "
        "model.attn_mask_type = 'causal' lets each attend to the conversations before it in its window; "
        "set model.attn_mask_type = 'block_causal' to train each conversation on its own"
    ]
    assert warnings("block_causal") == []
