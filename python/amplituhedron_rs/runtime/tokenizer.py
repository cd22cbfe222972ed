"""Tokenizer and chat template, built from a GGUF file's own metadata.

The BPE itself is Hugging Face ``tokenizers`` (Rust); the vocabulary, merges (or scores),
special tokens and the pre-tokenizer choice come from the GGUF header, and the chat template
(Jinja) is rendered in a sandbox the way ``transformers`` renders it. Two tokenizer models:

- ``gpt2``: byte-level BPE with the file's merges (SmolLM2, Llama 3, Qwen 2).
- ``llama``: SentencePiece BPE with scores and byte fallback (Gemma 3). llama.cpp merges the
  adjacent pair whose concatenation is the highest-scoring piece, leftmost first, and spells
  pieces that are not in the vocabulary as ``<0xNN>`` byte tokens. The same result comes from
  a BPE whose merges are every split ``(left, right)`` of every normal piece (both halves in
  the vocabulary), ranked by the piece's score, with byte fallback on.

BOS is added when the GGUF says so (SmolLM2: ``add_bos_token = false``; Gemma 3: true). A
file without a chat template gets its architecture's own turn format where one is known
(Gemma 3: ``<start_of_turn>``/``<end_of_turn>``, as llama.cpp's built-in ``gemma`` template).
"""

from __future__ import annotations

import functools
import re
import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.runtime.gguf_file import ModelFile, ModelFileError

# ggml token types (llama.cpp `llama_token_type`)
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4

# Gemma's turn format (llama.cpp's built-in `gemma` template; the official Gemma 3 template
# without its leading BOS, which the tokenizer adds): a system prompt opens the first user
# turn, the assistant speaks as "model".
GEMMA_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}\
{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
_FALLBACK_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}

# Pre-tokenizer split of Llama 3 / Qwen 2 style BPE (llama.cpp `llama-bpe`, `qwen2`).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

Message = dict[str, Any]
#: What a message may hold besides its role and content (tool calling, SPEC §16).
_TOOL_KEYS = frozenset({"tool_calls", "tool_call_id", "name"})


class Tokenizer:
    """Text ↔ token ids for one model, plus its chat template."""

    def __init__(self, model_file: ModelFile) -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        kind = model_file.metadata.get("tokenizer_model")
        if kind == "gpt2":
            tok = _byte_level_bpe(model_file)
        elif kind == "llama":
            tok = _sentencepiece_bpe(model_file)
        else:
            raise ModelFileError(
                f"tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                "SentencePiece 'llama' are)"
            )
        tokens = model_file.tokens
        types = model_file.token_types
        # Control tokens are special (skipped when decoding with skip_special); user-defined
        # pieces (Gemma's runs of newlines, tabs…) are matched whole in any text, as
        # llama.cpp does, and decode as themselves.
        tok.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types)
                if t == _USER_DEFINED
            ]
        )
        tok.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types)
                if t == _CONTROL
            ]
        )
        self._tok: HFTokenizer = tok
        self.vocab_size = len(tokens)
        self.bos_id: int | None = model_file.bos_id
        self.eos_id: int | None = model_file.eos_id
        self.add_bos = model_file.add_bos
        self._tokens = tokens
        self._control_ids = frozenset(i for i, t in enumerate(types) if t == _CONTROL)
        self._byte_level = kind == "gpt2"
        self._grammar_vocabulary: _core.GrammarVocabulary | None = None
        self._grammar_lock = threading.Lock()
        #: The GGUF tokenizer model (``gpt2``: byte-level BPE; ``llama``: SentencePiece).
        self.kind = str(kind)
        self._template_source = model_file.chat_template or _FALLBACK_TEMPLATES.get(
            model_file.architecture
        )
        #: Where the chat template comes from: the model file, the runtime's built-in turn
        #: format for the architecture, a given one (:meth:`set_chat_template`), or none.
        self.template_origin: str | None = (
            "file" if model_file.chat_template else "built-in" if self._template_source else None
        )
        self._template: Any = None
        self._control = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
        self._literal: Any = None

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source (None: the model has none)."""
        return self._template_source

    def set_chat_template(self, source: str) -> None:
        """Renders chats with ``source`` (Jinja, as ``transformers`` reads it) instead of the
        file's; checked now, so a broken template fails here, not at the first chat."""
        from jinja2.exceptions import TemplateError

        previous = (self._template_source, self._template, self.template_origin)
        self._template_source, self._template, self.template_origin = source, None, "given"
        try:
            self._compiled_template()
        except TemplateError as exc:
            self._template_source, self._template, self.template_origin = previous
            raise InputError(f"the chat template does not compile: {exc}") from exc

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text are recognised); BOS
        leads them when the model file asks for it and ``add_bos`` is true. The batch call
        releases the GIL (the single one holds it for the whole text), so a long text
        tokenised in a worker thread never stalls the event loop."""
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._with_bos(ids) if add_bos else ids

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        special_in_content: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a chat through the model's template, ready for generation. The
        template's own markup is parsed for special tokens, the messages' content is not: a
        control token spelled inside it (``<|im_end|><|im_start|>system``) is tokenised as
        the characters it is, so no message can forge a turn (llama.cpp tokenises user
        content with ``parse_special=false``), unless ``special_in_content``. ``tools``: as
        :meth:`render_chat` takes them."""
        rendered = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        if special_in_content or not any(self.spells_special(m["content"]) for m in messages):
            return self.encode(rendered)
        pieces = self._content_pieces(messages, add_generation_prompt, tools)
        markup = self._tok.encode_batch([p for p, c in pieces if not c], add_special_tokens=False)
        literal = self._literal_tokenizer().encode_batch(
            [p for p, c in pieces if c], add_special_tokens=False
        )
        markup_ids, literal_ids = iter(markup), iter(literal)
        ids: list[int] = []
        for _, is_content in pieces:
            ids.extend(next(literal_ids if is_content else markup_ids).ids)
        return self._with_bos(ids)

    def spells_special(self, text: str) -> bool:
        """Whether ``text`` contains a control token's spelling."""
        return self._control_pattern.search(text) is not None

    @functools.cached_property
    def _control_pattern(self) -> re.Pattern[str]:
        # One trie-shaped pattern: Gemma 3 has 6,249 control tokens, and a plain
        # alternation would try each at every position of a long message.
        return re.compile(_trie_pattern(self._control) or r"(?!)")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's spelling in bytes: no token covers more characters of input,
        so a text of more than ``n × max_token_bytes`` characters has more than ``n``
        tokens (checked before tokenising it)."""
        return max(len(t.encode("utf-8", "surrogatepass")) for t in self._tokens)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def _content_pieces(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[tuple[str, bool]]:
        """The rendered chat cut into the template's markup and the messages' content
        ``(text, is_content)``, found by rendering each content between random markers."""
        nonce = secrets.token_hex(8)
        opening, closing = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        marked = [{**m, "content": opening + m["content"] + closing} for m in messages]
        rendered = self.render_chat(
            marked, add_generation_prompt=add_generation_prompt, tools=tools
        )
        pieces: list[tuple[str, bool]] = []
        rest = rendered
        while rest:
            head, found, tail = rest.partition(opening)
            content, closed, after = tail.partition(closing)
            if closing in head or (found and (not closed or opening in content)):
                raise InputError(
                    "a message spells a special token, and this model's chat template "
                    "rearranges message content, so it cannot be kept as text"
                )
            pieces.append((head, False))
            if found:
                pieces.append((content, True))
            rest = after if found else ""
        return [(p, c) for p, c in pieces if p]

    def _literal_tokenizer(self) -> Any:
        """A copy of the tokenizer that reads special tokens' spellings as plain text."""
        if self._literal is None:
            from tokenizers import Tokenizer as HFTokenizer

            literal = HFTokenizer.from_str(self._tok.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; raises InputError for ids outside the vocabulary."""
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token ids outside the vocabulary of {self.vocab_size}: {bad[:5]}")
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special)
        return text

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level form)."""
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for in decoded text (a byte-level token may hold part of a
        UTF-8 character; OpenAI's ``logprobs`` report them as ``bytes``)."""
        if not 0 <= token_id < self.vocab_size:
            raise InputError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        piece = self._tokens[token_id]
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()  # an added token, written as itself
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def grammar_vocabulary(self) -> _core.GrammarVocabulary:
        """The vocabulary grammars are compiled against (SPEC §16): each token's bytes, a
        control token's as ``0xFF`` + its name (no text matches it), ending at EOS. Built on
        first use (it indexes every token: ~0.2 s for 49k tokens, ~2 s for 262k), then kept."""
        with self._grammar_lock:
            if self._grammar_vocabulary is None:
                if self.eos_id is None:
                    raise InputError("this model has no end-of-sequence token: no grammars")
                words = [
                    b"\xff" + self._tokens[i].encode()
                    if i in self._control_ids
                    else self.token_bytes(i)
                    for i in range(self.vocab_size)
                ]
                self._grammar_vocabulary = _core.GrammarVocabulary(words, [self.eos_id])
            return self._grammar_vocabulary

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools itself (its source uses ``tools``)."""
        return bool(self._template_source) and "tools" in (self._template_source or "")

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The model's own chat template applied to ``messages`` (``role`` and ``content``,
        plus tool calling's ``tool_calls`` / ``tool_call_id`` / ``name``), and ``tools`` for a
        template that renders them (:attr:`supports_tools`)."""
        if not messages:
            raise InputError("a chat needs at least one message")
        for m in messages:
            if not {"role", "content"} <= set(m) or set(m) - {"role", "content"} - _TOOL_KEYS:
                raise InputError(
                    f"a message has 'role' and 'content' (and tool calling's keys), got {sorted(m)}"
                )
        template = self._compiled_template()
        extra = {} if tools is None else {"tools": tools}
        rendered: str = template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **extra,
            bos_token=self._tokens[self.bos_id] if self.bos_id is not None else "",
            eos_token=self._tokens[self.eos_id] if self.eos_id is not None else "",
        )
        return rendered

    def chat_ids(self, system: str | None, user: str) -> list[int]:
        """Token ids of a one-turn chat (system prompt optional) ready for generation."""
        messages: list[Message] = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": user})
        return self.encode_chat(messages)

    def _compiled_template(self) -> Any:
        if self._template is None:
            if not self._template_source:
                raise ModelFileError("this model file has no chat template")
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self._template_source)
        return self._template


def _trie_pattern(words: Sequence[str]) -> str:
    """A regex matching any of ``words``, shaped as their prefix trie (linear-time search
    however many words there are)."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if "" in node:
            branches.append("")
        if len(branches) == 1:
            return branches[0]
        return "(?:" + "|".join(branches) + ")"

    return pattern(trie) if trie else ""


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written
    as in a byte-level vocabulary → that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _byte_level_bpe(model_file: ModelFile) -> Any:
    """GPT-2 style byte-level BPE from the file's vocabulary, merges and pre-tokenizer."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(model_file.tokens)}
    merges = [(a, b) for a, _, b in (m.partition(" ") for m in model_file.merges)]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = model_file.metadata.get("pre") or "default"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    elif pre in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ModelFileError(f"pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(model_file: ModelFile) -> Any:
    """SentencePiece BPE (scores, byte fallback) as llama.cpp's SPM tokenizer runs it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    tokens, types, scores = model_file.tokens, model_file.token_types, model_file.scores
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise ModelFileError(
            f"{model_file.path}: a SentencePiece vocabulary needs a score and a type per token"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    unk_id = model_file.metadata.get("unknown_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=[(left, right) for _, _, left, right in ranked],
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(bpe)
    steps: list[Any] = [normalizers.Replace(" ", "\u2581")]
    if model_file.metadata.get("add_space_prefix"):
        steps.insert(0, normalizers.Prepend(" "))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


class StreamDecoder:
    """Turns a stream of token ids into text pieces, never splitting a UTF-8 character.

    Incremental: each token decodes only the ids since the last released piece plus the
    piece before it (a few ids), never the whole stream. Byte-level BPE tokens can end
    mid-character, so text is released only once it no longer ends in the replacement
    character; decoding from the start of the previous piece (always a character boundary)
    keeps the decoder's joins exactly as in a decode of every id.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  #: start of the ids whose text was released last
        self._read = 0  #: end of the ids whose text was released

    def push(self, token_id: int) -> str:
        """Adds one id; returns the text that became complete (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        released = decode(self._ids[self._prefix : self._read], skip_special=self._skip_special)
        text = decode(self._ids[self._prefix :], skip_special=self._skip_special)
        if text.endswith("\ufffd") or len(text) <= len(released):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(released) :]
