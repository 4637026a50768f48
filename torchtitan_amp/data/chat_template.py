"""Chat templates: Hugging Face tokenizers' `chat_template` (jinja2), rendered as transformers'
`apply_chat_template` renders it, and the assistant spans that SFT trains on.

The template comes from `training.chat_template` when set (a name of `NAMED_TEMPLATES`, shipped
here, or a .jinja file; the job sets it on the tokenizer as `chat_template`, as transformers'
tokenizers carry theirs), else from a tokenizer folder (its chat_template.jinja, or
tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"} where "default"
is taken), or, for the byte tokenizer, the template shipped here (`BYTE_TEMPLATE`). It renders in a sandboxed jinja2
environment set up like transformers' (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, `{% generation %}`) with the variables `messages`, `bos_token`, `eos_token` and
`add_generation_prompt`.

Assistant spans: where the template marks them with `{% generation %}...{% endgeneration %}`, those
character ranges; otherwise found incrementally: assistant turn i is what rendering messages[:i+1]
adds to messages[:i] rendered with the generation prompt (its content and end-of-turn marker).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from torchtitan_amp.core.errors import DataError

ROLES = ("system", "user", "assistant")

# The byte tokenizer's template: role headers in plain text; `eos_token` ends each assistant turn
# (the chat encoder maps the byte tokenizer's "</s>" to its EOS id, so generation stops there).
BYTE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# The byte tokenizer's specials as templates spell them.
BYTE_BOS_TOKEN = "<s>"
BYTE_EOS_TOKEN = "</s>"
# ChatML, as transformers' documentation gives it: `<|im_start|>ROLE\n...<|im_end|>\n` per message
# (the markers are one token each where the vocabulary has them as specials, text otherwise).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# training.chat_template's names: templates for tokenizers that ship none (any tokenizer may use them).
NAMED_TEMPLATES = {"byte": BYTE_TEMPLATE, "chatml": CHATML_TEMPLATE}

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """The template compiled in transformers' sandboxed environment (cached per source)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body and records its character
        range in the output (transformers' AssistantTracker)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller: Any) -> str:
            text = caller()
            tracking = getattr(self.environment, "tracking", None)
            if tracking is not None:
                parts, spans = tracking
                start = sum(len(p) for p in parts)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def _tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"chat template: jinja2 syntax error on line {e.lineno}: {e.message}") from None


class RenderedChat(str):
    """A rendered conversation (the text, as a str) with `literal`: the character positions where
    a special token's string spelled in a message's content starts. The chat encoder (data/chat.py)
    encodes those as text: only the template's own markers become special tokens."""

    literal: frozenset[int] = frozenset()


def _occurrences(text: str, token: str) -> list[int]:
    found, i = [], text.find(token)
    while i >= 0:
        found.append(i)
        i = text.find(token, i + 1)
    return found


def escape_specials(
    messages: list[dict[str, str]], specials: tuple[str, ...], avoid: str
) -> tuple[list[dict[str, str]], dict[str, str]]:
    """`messages` with the first character of every special string spelled in a content replaced by
    a private-use marker (one per replaced character, found in no content and not in `avoid`, the
    template source), so that the rendered text holds no special string from a message; and the
    markers' map back to the characters. One character for one: rendered offsets stay valid.

    Args:
        messages: the conversation ({"role", "content"} dicts).
        specials: the tokenizer's special tokens' strings.
        avoid: text the markers must not occur in (the template source).
    """
    hits = [sorted({i for s in specials if s for i in _occurrences(m["content"], s)}) for m in messages]
    if not any(hits):
        return messages, {}
    seen = avoid + "".join(m["content"] for m in messages)
    markers: dict[str, str] = {}
    code = 0xE000
    for char in sorted({m["content"][i] for m, at in zip(messages, hits) for i in at}):
        while chr(code) in seen:
            code += 1
        markers[char] = chr(code)
        code += 1
    out = []
    for m, at in zip(messages, hits):
        if at:
            chars = list(m["content"])
            for i in at:
                chars[i] = markers[chars[i]]
            m = {**m, "content": "".join(chars)}
        out.append(m)
    return out, {marker: char for char, marker in markers.items()}


class ChatTemplate:
    """A chat template with the special-token strings it renders.

    Args:
        source: the jinja2 template text.
        bos_token: what `{{ bos_token }}` renders.
        eos_token: what `{{ eos_token }}` renders.
        where: where the template came from (for error messages).
        specials: the tokenizer's special tokens' strings: spelled in a message, they are marked
            literal in the rendered text (RenderedChat.literal), never matched as specials.
    """

    def __init__(self, source: str, bos_token: str, eos_token: str, where: str, specials: tuple[str, ...] = ()) -> None:
        self.source, self.bos_token, self.eos_token, self.where = source, bos_token, eos_token, where
        self.specials = specials
        self.marked = bool(_GENERATION_TAG.search(source))
        self._template = _compile(source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> RenderedChat:
        """The conversation's text, as apply_chat_template(messages, tokenize=False) gives it, with
        the positions of special strings spelled in its messages (RenderedChat.literal).

        Args:
            messages: the conversation ({"role", "content"} dicts).
            add_generation_prompt: whether to end with the header that opens an assistant turn.
        """
        return self._render(messages, add_generation_prompt, None)

    def _render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, spans: list[tuple[int, int]] | None
    ) -> RenderedChat:
        import jinja2

        messages, restore = escape_specials(messages, self.specials, self.source)
        env = self._template.environment
        parts: list[str] = []
        # The generation tracker reads this while the render runs (renders are sequential).
        env.tracking = (parts, spans) if spans is not None else None
        try:
            for block in self._template.generate(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
            ):
                parts.append(block)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"chat template ({self.where}) failed to render: {' '.join(str(e).split())}") from None
        finally:
            env.tracking = None
        text = "".join(parts)
        if not restore:
            return RenderedChat(text)
        out = RenderedChat("".join(restore.get(c, c) for c in text))
        out.literal = frozenset(i for i, c in enumerate(text) if c in restore)
        return out

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[RenderedChat, list[tuple[int, int]]]:
        """The whole conversation's text and the character ranges [start, end) of its assistant
        turns (what SFT trains on); an empty list when the template renders none.

        Args:
            messages: the conversation ({"role", "content"} dicts).
        """
        if self.marked:
            spans: list[tuple[int, int]] = []
            text = self._render(messages, False, spans)
            return text, [s for s in spans if s[1] > s[0]]
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not upto.startswith(prompt) or not text.startswith(upto):
                raise DataError(
                    f"chat template ({self.where}) does not render the conversation prefix by prefix (turn "
                    f"{i}): its assistant text cannot be found; mark it with {{% generation %}}"
                )
            if len(upto) > len(prompt):
                spans.append((len(prompt), len(upto)))
        return text, spans


def _folder_template(folder: Path) -> str | None:
    """A tokenizer folder's chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        value = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"{config_path}: unreadable ({' '.join(str(e).split())})") from None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise DataError(f"{config_path}: 'chat_template' must be a string or a list with a 'default' template")
    return value


def chosen_template(setting: str) -> tuple[str, str]:
    """(source, where it came from) of training.chat_template: a name of NAMED_TEMPLATES or a path
    to a .jinja file; DataError in one line otherwise.

    Args:
        setting: the config value (not empty).
    """
    if setting in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[setting], f"the shipped {setting!r} template"
    path = Path(setting)
    if path.suffix == ".jinja" or path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except FileNotFoundError:
            raise DataError(f"training.chat_template {setting!r}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"training.chat_template {setting!r}: unreadable ({' '.join(str(e).split())})") from None
    raise DataError(
        f"training.chat_template {setting!r} is neither a shipped template ({', '.join(NAMED_TEMPLATES)}) "
        "nor a .jinja file"
    )


def template_for(tokenizer: Any) -> ChatTemplate:
    """The chat template of `tokenizer`: its `chat_template` setting (training.chat_template, set by
    the job) when given, else the byte tokenizer's shipped one or its folder's.

    Args:
        tokenizer: a data.tokenizer tokenizer (ByteTokenizer, or an HFTokenizer from a folder).
    """
    setting = getattr(tokenizer, "chat_template", "")
    if getattr(tokenizer, "cache_key", None) == "byte":
        source, where = (
            chosen_template(setting) if setting else (BYTE_TEMPLATE, "the byte tokenizer's shipped template")
        )
        return ChatTemplate(source, BYTE_BOS_TOKEN, BYTE_EOS_TOKEN, where, (BYTE_BOS_TOKEN, BYTE_EOS_TOKEN))
    path = getattr(tokenizer, "path", None)
    if not hasattr(tokenizer, "encode_with_offsets") or path is None:
        raise DataError(
            "chat data needs model.tokenizer = 'byte' or a Hugging Face tokenizer folder, not "
            f"{type(tokenizer).__name__}"
        )
    specials = tuple(tokenizer.special_tokens())
    if setting:
        source, where = chosen_template(setting)
        return ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token, where, specials)
    folder_source = _folder_template(Path(path).parent)
    if folder_source is None:
        raise DataError(
            f"tokenizer folder {Path(path).parent} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's 'chat_template'); set training.chat_template (a shipped name: "
            f"{', '.join(NAMED_TEMPLATES)}; or a .jinja file), add one to the folder, or use model.tokenizer = 'byte'"
        )
    return ChatTemplate(folder_source, tokenizer.bos_token, tokenizer.eos_token, str(Path(path).parent), specials)
