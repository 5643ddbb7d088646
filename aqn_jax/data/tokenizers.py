"""Tokenizers: one small interface (`Tokenizer`) with two implementations.

* `HFTokenizer` wraps a Hugging Face `tokenizer.json` (e.g. a local Qwen2.5 snapshot) through the
  Rust `tokenizers` library and renders the snapshot's Jinja chat template the way
  `transformers` does. It deliberately does not import `transformers`: that import alone takes
  seconds, and rollout workers only need encode/decode and the chat template.
* `CharTokenizer` is the embedded tokenizer of the synthetic arithmetic task: a fixed vocabulary
  of special tokens, a few dozen task words and every printable ASCII character, small enough
  (<= 256 ids) for the embedded tiny model and fully serialisable so a run directory can store
  the exact tokenizer it was trained with.

`load_tokenizer(path)` picks the implementation from what a directory holds.

Conventions shared by both implementations (the rest of the code relies on them):
  * `encode` adds no special tokens, but special-token *text* in the input (for example
    "<|im_end|>" or "<eos>") is encoded as the special id, so `encode_chat(m)` equals
    `encode(apply_chat_template(m))`.
  * `decode` always drops `pad_id` (padding is never content) and rejects ids outside
    `[0, vocab_size)`, because such an id means the sampler did not mask logits beyond the
    tokenizer's vocabulary, which should be fixed there rather than silently decoded away.
"""

from __future__ import annotations

import abc
import json
import os
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CHARS",
    "CHAR_TOKENIZER_FILE",
    "DEFAULT_WORDS",
    "INSTRUCTION_SUFFIX",
    "SPECIAL_TOKENS",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

# File names inside a tokenizer directory.
HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
HF_CHAT_TEMPLATE_JINJA_FILE = "chat_template.jinja"
HF_CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
HF_MODEL_CONFIG_FILE = "config.json"
HF_GENERATION_CONFIG_FILE = "generation_config.json"
CHAR_TOKENIZER_FILE = "char_tokenizer.json"

# The GSM8K-style instruction appended to every synthetic question (one token in CharTokenizer).
INSTRUCTION_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'


def _as_id_list(ids: Any, vocab_size: int) -> list[int]:
    """Convert a list / tuple / numpy (or jax) 1-D array of token ids to a checked list of ints.

    Range-checking here gives one clear error for an id the sampler should never have produced
    (e.g. a model with a larger embedding table than the tokenizer's vocabulary).
    """
    arr = np.asarray(ids)
    if arr.size == 0:
        return []
    if arr.ndim != 1:
        raise ValueError(
            f"decode expects a 1-D sequence of token ids, got an array of shape {arr.shape}; "
            "decode each row separately"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"decode expects integer token ids, got dtype {arr.dtype}; cast the ids to int first"
        )
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"token id {int(arr[i])} at position {i} is outside the tokenizer vocabulary "
            f"[0, {vocab_size}); mask logits of ids >= vocab_size ({vocab_size}) before sampling"
        )
    return [int(x) for x in arr]


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and return plain-dict copies without None-valued keys.

    Dropping None values mirrors `transformers` (APIs often send `content=None`, which templates
    would otherwise render as the text "None").
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            "messages must be a list of dicts with 'role' and 'content', "
            f"got {type(messages).__name__}"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}: {message!r}"
            )
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class Tokenizer(abc.ABC):
    """The tokenizer interface used by data, rollout and reward code.

    Implementations must keep `encode_chat(m) == encode(apply_chat_template(m))`; the default
    implementations of `encode_chat` and `encode_batch` below rely only on `encode` and
    `apply_chat_template`.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (max id + 1); may be below the model's."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Id used to pad batches; always dropped by `decode`."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """Id that ends a generated response (generation stops on it)."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None when the tokenizer has none (as for Qwen2.5)."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generated response, `eos_id` first (the sampler stops on any
        of them). By default `eos_id` alone; a snapshot's `generation_config.json` may list
        more (Qwen2.5-Instruct: 151645 `<|im_end|>` and 151643 `<|endoftext|>`)."""
        return (self.eos_id,)

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Encode text without adding special tokens (special-token text still maps to its id)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Decode ids to text; pad ids are always dropped, other specials if requested."""

    @abc.abstractmethod
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text (no tokenization)."""

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render a conversation with the chat template, then encode it (specials -> their ids)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Encode several texts; implementations may override with a faster batched path."""
        return [self.encode(t) for t in texts]

    @property
    def unk_id(self) -> int | None:
        """The id of text the tokenizer cannot encode, or None (a byte-level BPE has none)."""
        return None

    def unknown_chars(self, text: str) -> list[str]:
        """The characters of `text` that encode as `unk_id`, each once, in order."""
        unk = self.unk_id
        if unk is None:
            return []
        return [c for c in dict.fromkeys(text) if unk in self.encode(c)]


# ----------------------------------------------------------------------------------------------
# Hugging Face tokenizer
# ----------------------------------------------------------------------------------------------


def _token_content(value: Any, field: str, source: Path) -> str | None:
    """Read a special-token entry saved either as a plain string or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{source}: field '{field}' must be a string or a dict with a string 'content', "
        f"got {value!r}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _eos_ids_of(path: Path) -> list[int] | None:
    """`eos_token_id` of a model's config.json or generation_config.json (an int or a list of
    ints; HF allows both), or None when the file or the field is absent."""
    if not path.is_file():
        return None
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return ids


def _check_eos(
    root: Path, rust: Any, decoder: Mapping[str, Any], eos: str, eos_id: int
) -> list[int]:
    """The snapshot's eos is a special token and one of the ids its model's config.json /
    generation_config.json end a turn on (where they state any); returns those ids (the
    generation config's first), the sampler's further stop ids. One line naming the files and
    ids otherwise: an ordinary vocabulary token as eos (transformers 5.17's GGUF fallback writes
    Qwen's ordinary `</s>`, id 128247) lets every response run to the token budget."""
    added = rust.get_added_tokens_decoder()
    special = eos_id in added and bool(added[eos_id].special)
    entry = decoder.get(str(eos_id))
    if isinstance(entry, Mapping) and entry.get("content") == eos:
        special = special or bool(entry.get("special"))
    stated = {
        name: ids
        for name in (HF_GENERATION_CONFIG_FILE, HF_MODEL_CONFIG_FILE)
        if (ids := _eos_ids_of(root / name)) is not None
    }
    model_ids = list(dict.fromkeys(i for ids in stated.values() for i in ids))
    said = "; ".join(f"{name} eos_token_id {ids}" for name, ids in stated.items())
    if not special:
        raise ValueError(
            f"{root}: eos_token {eos!r} (id {eos_id}, {HF_CONFIG_FILE}) is an ordinary"
            f" vocabulary token, not a special one{'; ' + said if said else ''}: set eos_token"
            " to the model's end-of-turn token"
        )
    if model_ids and eos_id not in model_ids:
        raise ValueError(
            f"{root}: eos_token {eos!r} (id {eos_id}, {HF_CONFIG_FILE}) is not an id the"
            f" model ends a turn on ({said}): set eos_token to one of those"
        )
    return model_ids


def _compile_chat_template(template: str) -> Any:
    """Compile a chat template in the same sandboxed Jinja environment `transformers` uses.

    Same options (trim_blocks, lstrip_blocks, loopcontrols) and helpers (raise_exception,
    strftime_now, a `tojson` that does not HTML-escape), so rendering is byte-identical.
    """
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (`tokenizer.json`) and its chat template, no transformers.

    Build with `HFTokenizer.from_pretrained(local_dir)`. The special-token strings are passed to
    the chat template as `bos_token` / `eos_token` / `pad_token` / `unk_token` (only those that
    are set, like transformers), and `tools` / `documents` default to None.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
        unk_token: str | None = None,
        added_tokens: Mapping[str, int] | None = None,
        name_or_path: str = "<in-memory>",
        stop_ids: Sequence[int] = (),
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`.

        Args:
          tokenizer: the Rust tokenizer (padding/truncation are switched off so `encode`
            never silently pads or cuts text).
          chat_template: Jinja source of the chat template.
          eos_token / pad_token / bos_token / unk_token: special-token strings; pad falls back
            to eos when None.
          added_tokens: extra content -> id map (from `added_tokens_decoder`) consulted when the
            tokenizer itself does not know a special-token string.
          name_or_path: used in error messages and repr.
          stop_ids: further ids that end a response besides eos (the model's generation
            config); `stop_ids` is eos first, then these, each once.
        """
        self._tok = tokenizer
        self._tok.no_padding()
        self._tok.no_truncation()
        self._name = name_or_path
        self._added = dict(added_tokens or {})
        self._chat_template_src = chat_template
        self._template = _compile_chat_template(chat_template)
        self._vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._special_strings = {
            k: v
            for k, v in (
                ("bos_token", bos_token),
                ("eos_token", eos_token),
                ("unk_token", unk_token),
                ("pad_token", pad_token),
            )
            if v is not None
        }
        self._eos_id = self._id_of(eos_token, "eos_token")
        self._pad_id = self._eos_id if pad_token is None else self._id_of(pad_token, "pad_token")
        self._bos_id = None if bos_token is None else self._id_of(bos_token, "bos_token")
        bad = [int(i) for i in stop_ids if not 0 <= int(i) < self._vocab_size]
        if bad:
            raise ValueError(
                f"{self._name}: stop ids {bad} are outside the vocabulary [0, {self._vocab_size})"
            )
        self._stop_ids = tuple(dict.fromkeys([self._eos_id, *map(int, stop_ids)]))

    def _id_of(self, token: str, field: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            tid = self._added.get(token)
        if tid is None:
            raise ValueError(
                f"{self._name}: {field} {token!r} is not in the vocabulary of {HF_TOKENIZER_FILE} "
                "nor in added_tokens_decoder; fix the token string in "
                f"{HF_CONFIG_FILE} or add the token to the tokenizer"
            )
        return int(tid)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Load from a LOCAL snapshot directory (never downloads).

        Reads `tokenizer.json`, special tokens from `tokenizer_config.json` (falling back to
        `special_tokens_map.json`), and the chat template from `chat_template.jinja` (what newer
        transformers save), else `tokenizer_config.json["chat_template"]`, else
        `chat_template.json`.
        """
        from tokenizers import Tokenizer as RustTokenizer

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(
                f"tokenizer directory {str(root)!r} does not exist or is not a directory; pass a "
                f"local snapshot directory containing {HF_TOKENIZER_FILE} and {HF_CONFIG_FILE}"
            )
        tok_file = root / HF_TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{HF_TOKENIZER_FILE} is missing from tokenizer directory {str(root)!r}; only "
                "fast (tokenizer.json) tokenizers are supported"
            )
        cfg_file = root / HF_CONFIG_FILE
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{HF_CONFIG_FILE} is missing from tokenizer directory {str(root)!r}; it names the "
                "eos/pad tokens and usually holds the chat template"
            )
        config = _read_json(cfg_file)
        special_map: dict[str, Any] = {}
        if (root / HF_SPECIAL_TOKENS_MAP_FILE).is_file():
            special_map = _read_json(root / HF_SPECIAL_TOKENS_MAP_FILE)

        def special(field: str) -> str | None:
            if config.get(field) is not None:
                return _token_content(config[field], field, cfg_file)
            return _token_content(special_map.get(field), field, root / HF_SPECIAL_TOKENS_MAP_FILE)

        eos = special("eos_token")
        if eos is None:
            raise ValueError(
                f"no eos_token in {cfg_file} (nor in {HF_SPECIAL_TOKENS_MAP_FILE}); set "
                '"eos_token" (for Qwen2.5-Instruct "<|im_end|>")'
            )

        added: dict[str, int] = {}
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ValueError(
                f"{cfg_file}: 'added_tokens_decoder' must map ids to tokens, got {decoder!r}"
            )
        for key, entry in decoder.items():
            content = _token_content(entry, f"added_tokens_decoder[{key}]", cfg_file)
            try:
                added[content] = int(key)
            except ValueError as e:
                raise ValueError(
                    f"{cfg_file}: added_tokens_decoder key {key!r} is not an integer id"
                ) from e

        rust = RustTokenizer.from_file(str(tok_file))
        tok = cls(
            rust,
            chat_template=cls._find_chat_template(root, config),
            eos_token=eos,
            pad_token=special("pad_token"),
            bos_token=special("bos_token"),
            unk_token=special("unk_token"),
            added_tokens=added,
            name_or_path=str(root),
        )
        model_stops = _check_eos(root, rust, decoder, eos, tok.eos_id)
        outside = [i for i in model_stops if not 0 <= i < tok.vocab_size]
        if outside:
            raise ValueError(
                f"{root}: eos_token_id {outside} of the model's config is outside the"
                f" tokenizer's vocabulary [0, {tok.vocab_size})"
            )
        tok._stop_ids = tuple(dict.fromkeys([tok.eos_id, *model_stops]))
        return tok

    @staticmethod
    def _find_chat_template(root: Path, config: Mapping[str, Any]) -> str:
        jinja_file = root / HF_CHAT_TEMPLATE_JINJA_FILE
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = config.get("chat_template")
        source = root / HF_CONFIG_FILE
        if template is None and (root / HF_CHAT_TEMPLATE_JSON_FILE).is_file():
            source = root / HF_CHAT_TEMPLATE_JSON_FILE
            template = _read_json(source).get("chat_template")
        if isinstance(template, list):
            # Older multi-template format: [{"name": "default", "template": "..."}, ...].
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" not in named:
                raise ValueError(
                    f"{source}: 'chat_template' lists templates {sorted(map(str, named))} but no "
                    "'default' one"
                )
            template = named["default"]
        if template is None:
            raise ValueError(
                f"no chat template in tokenizer directory {str(root)!r}: looked for "
                f"{HF_CHAT_TEMPLATE_JINJA_FILE}, 'chat_template' in {HF_CONFIG_FILE} and "
                f"{HF_CHAT_TEMPLATE_JSON_FILE}; use an Instruct snapshot or add a template"
            )
        if not isinstance(template, str):
            raise ValueError(f"{source}: 'chat_template' must be a string, got {template!r}")
        return template

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def unk_id(self) -> int | None:
        unk = self._special_strings.get("unk_token")
        if unk is None:
            return None
        tid = self._tok.token_to_id(unk)
        return self._added.get(unk) if tid is None else tid

    @property
    def chat_template(self) -> str:
        """The Jinja source in use (for logging / storing with a run)."""
        return self._chat_template_src

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        id_list = [i for i in _as_id_list(ids, self._vocab_size) if i != self._pad_id]
        return self._tok.decode(id_list, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render like `transformers`' `apply_chat_template(..., tokenize=False)`.

        Extra keyword arguments become template variables (overriding the special-token
        strings), e.g. `tools=[...]`; a template's `raise_exception` surfaces as ValueError.
        """
        import jinja2

        variables: dict[str, Any] = {"tools": None, "documents": None, **self._special_strings}
        variables.update(template_kwargs)
        try:
            return self._template.render(
                messages=_check_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template of {self._name} rejected the messages: {e}") from e

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self._name!r}, vocab_size={self._vocab_size}, "
            f"eos_id={self._eos_id}, pad_id={self._pad_id}, bos_id={self._bos_id})"
        )


# ----------------------------------------------------------------------------------------------
# Character tokenizer for the embedded synthetic task
# ----------------------------------------------------------------------------------------------

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
ROLE_TOKENS = {"user": "<|user|>", "assistant": "<|assistant|>", "system": "<|system|>"}
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK, *ROLE_TOKENS.values())

# Printable ASCII except the rarely meaningful \x0b \x0c \r (space, \n and \t stay in).
CHARS: tuple[str, ...] = tuple(c for c in string.printable if c not in "\x0b\x0c\r")

# Multi-character tokens frequent in the synthetic GSM8K-style problems; shortening sequences
# makes the tiny model's context go further. Order fixes their ids (7, 8, ...): append only.
DEFAULT_WORDS: tuple[str, ...] = (
    "####",
    INSTRUCTION_SUFFIX,
    " How many",
    " How much",
    # objects
    " apples",
    " oranges",
    " bananas",
    " books",
    " pencils",
    " marbles",
    " cookies",
    " candies",
    " stickers",
    " cards",
    " toys",
    " flowers",
    " eggs",
    " coins",
    " dollars",
    " boxes",
    " bags",
    " friends",
    # verbs
    " has",
    " have",
    " had",
    " does",
    " did",
    " buys",
    " bought",
    " gives",
    " gave",
    " gets",
    " finds",
    " loses",
    " eats",
    " sells",
    " makes",
    " spends",
    " shares",
    # quantities and connectives
    " more",
    " fewer",
    " each",
    " every",
    " total",
    " left",
    " away",
    " altogether",
    " times",
    " equally",
    " among",
    " now",
    " then",
    " after",
    " and",
    " the",
    " of",
    " to",
    " in",
    " with",
    " for",
    " from",
    " is",
    " are",
    " there",
    " he",
    " she",
    " they",
    " his",
    " her",
    " He",
    " She",
    " They",
    " Then",
    " If",
)


class CharTokenizer(Tokenizer):
    """Greedy longest-match tokenizer over specials, task words and printable ASCII characters.

    Id layout (default words: 7 + 74 + 97 = 178 ids, within the tiny model's 256):
      0 `<pad>`, 1 `<eos>`, 2 `<bos>`, 3 `<unk>`, 4 `<|user|>`, 5 `<|assistant|>`,
      6 `<|system|>`; then `words` in order (7 = "####", 8 = INSTRUCTION_SUFFIX, ...);
      then every character of `CHARS` in `string.printable` order.

    Encoding takes, at each position, the longest special/word that matches, else the single
    character, else `<unk>`; so `decode(encode(s)) == s` for printable ASCII that contains no
    special-token text. Special-token text such as "<eos>" is encoded as its special id (which
    `decode` drops unless `skip_special_tokens=False`; `<pad>` is always dropped).

    Chat template (no system default, no variables):
      each message -> "<|{role}|>" + content + "<eos>", roles system/user/assistant;
      generation prompt -> "<|assistant|>".
    E.g. [{"role": "user", "content": "1 + 2?"}] -> "<|user|>1 + 2?<eos><|assistant|>"; the
    model answers and ends its turn with `<eos>` (= `eos_id`).
    """

    def __init__(self, words: Sequence[str] = DEFAULT_WORDS) -> None:
        """Build the vocabulary; `words` (multi-character strings) may extend `DEFAULT_WORDS`."""
        if isinstance(words, str):
            raise ValueError(f"words must be a sequence of strings, not a single string {words!r}")
        words = tuple(words)
        seen: set[str] = set(SPECIAL_TOKENS)
        for i, w in enumerate(words):
            if not isinstance(w, str) or len(w) < 2:
                raise ValueError(
                    f"words[{i}] = {w!r}: each word must be a string of >= 2 characters "
                    "(single characters are already in the vocabulary)"
                )
            if w in seen:
                raise ValueError(
                    f"words[{i}] = {w!r} is duplicated or collides with a special token "
                    f"{list(SPECIAL_TOKENS)}"
                )
            seen.add(w)
        self._words = words
        self._vocab: tuple[str, ...] = (*SPECIAL_TOKENS, *words, *CHARS)
        self._ids = {tok: i for i, tok in enumerate(self._vocab)}
        self._n_special = len(SPECIAL_TOKENS)
        multi = sorted((*SPECIAL_TOKENS, *words), key=len, reverse=True)  # stable: ties keep order
        self._pattern = re.compile("|".join(map(re.escape, multi)) + "|.", flags=re.DOTALL)
        self._unk_id = self._ids[UNK]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def pad_id(self) -> int:
        return self._ids[PAD]

    @property
    def eos_id(self) -> int:
        return self._ids[EOS]

    @property
    def bos_id(self) -> int | None:
        return self._ids[BOS]

    @property
    def unk_id(self) -> int:
        return self._unk_id

    @property
    def words(self) -> tuple[str, ...]:
        return self._words

    @property
    def vocab(self) -> tuple[str, ...]:
        """Token strings indexed by id."""
        return self._vocab

    def token_to_id(self, token: str) -> int:
        """Id of a vocabulary entry (special, word or single character)."""
        try:
            return self._ids[token]
        except KeyError:
            raise KeyError(f"{token!r} is not a token of this CharTokenizer") from None

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        unk = self._unk_id
        return [ids.get(m, unk) for m in self._pattern.findall(text)]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        pad = self.pad_id
        lo = self._n_special if skip_special_tokens else 0
        vocab = self._vocab
        return "".join(vocab[i] for i in _as_id_list(ids, len(vocab)) if i >= lo and i != pad)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render with the fixed template in the class docstring.

        `template_kwargs` are accepted for interface compatibility and ignored (the template
        uses no variables), as `transformers` ignores variables a template does not reference.
        """
        del template_kwargs
        parts = []
        for i, message in enumerate(_check_messages(messages)):
            role = message.get("role")
            if role not in ROLE_TOKENS:
                raise ValueError(
                    f"messages[{i}]['role'] = {role!r} is not supported by CharTokenizer; "
                    f"allowed roles: {sorted(ROLE_TOKENS)}"
                )
            content = message.get("content")
            if not isinstance(content, str):
                raise ValueError(
                    f"messages[{i}]['content'] must be a string, got {type(content).__name__}"
                )
            parts.append(ROLE_TOKENS[role] + content + EOS)
        if add_generation_prompt:
            parts.append(ROLE_TOKENS["assistant"])
        return "".join(parts)

    # -- serialisation ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description; `vocab` is stored so a reload can verify the ids."""
        return {
            "type": "char",
            "version": 1,
            "words": list(self._words),
            "vocab": list(self._vocab),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CharTokenizer:
        """Rebuild from `to_dict()` output; fails if the stored id layout would change."""
        if not isinstance(data, Mapping) or data.get("type") != "char":
            got = data.get("type") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"not a CharTokenizer description: expected type 'char', got {got!r}")
        words = data.get("words")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ValueError(
                f"CharTokenizer description: 'words' must be a list of strings, got {words!r}"
            )
        tok = cls(words)
        stored = data.get("vocab")
        if stored is not None and list(stored) != list(tok.vocab):
            mismatch = next(
                (i for i, (a, b) in enumerate(zip(stored, tok.vocab, strict=False)) if a != b),
                min(len(stored), tok.vocab_size),
            )
            raise ValueError(
                f"stored CharTokenizer vocab differs from the rebuilt one at id {mismatch} "
                f"(stored size {len(stored)}, rebuilt {tok.vocab_size}); it was written by an "
                "incompatible version of aqn_jax.data.tokenizers"
            )
        return tok

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `char_tokenizer.json` into directory `path` (created if needed); return it."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        file = root / CHAR_TOKENIZER_FILE
        file.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return file

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CharTokenizer:
        """Load from a directory holding `char_tokenizer.json`, or from that file itself."""
        file = Path(path)
        if file.is_dir() or file.suffix != ".json":
            file = file / CHAR_TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{str(file)!r} not found; expected a directory written by CharTokenizer.save"
            )
        return cls.from_dict(_read_json(file))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other._vocab == self._vocab

    def __hash__(self) -> int:
        return hash(self._vocab)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, words={len(self._words)})"


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """Load the tokenizer a config names.

    None or "" -> the embedded `CharTokenizer()`; a directory with `tokenizer.json` -> HFTokenizer
    (checked first); a directory with `char_tokenizer.json` (or that file) -> CharTokenizer.load.
    """
    if path is None or str(path) == "":
        return CharTokenizer()
    p = Path(path)
    if p.is_file() and p.name == CHAR_TOKENIZER_FILE:
        return CharTokenizer.load(p)
    if not p.is_dir():
        raise FileNotFoundError(
            f"tokenizer path {str(p)!r} is not a directory; pass a local HF snapshot directory "
            f"(with {HF_TOKENIZER_FILE}), a directory with {CHAR_TOKENIZER_FILE}, or None/'' for "
            "the embedded character tokenizer"
        )
    if (p / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer.from_pretrained(p)
    if (p / CHAR_TOKENIZER_FILE).is_file():
        return CharTokenizer.load(p)
    raise ValueError(
        f"tokenizer directory {str(p)!r} holds neither {HF_TOKENIZER_FILE} (Hugging Face) nor "
        f"{CHAR_TOKENIZER_FILE} (CharTokenizer); pass None/'' for the embedded character tokenizer"
    )
