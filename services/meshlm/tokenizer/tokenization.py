"""Text <-> token ids for one Hugging Face checkpoint, and the prompt checks made before scheduling.

`TextTokenizer.from_pretrained(path)` reads the files of an HF-layout directory:

- `tokenizer.json` (required): the `tokenizers` pipeline. Truncation and padding saved in it are
  switched off: a prompt is never cut silently, `check_context` rejects it instead.
- `tokenizer_config.json`: bos/eos tokens (strings or AddedToken dicts), `add_bos_token`, the
  chat template (or `chat_template.jinja` beside it).
- `config.json`: the context length (`max_position_embeddings` and its older aliases).
- `generation_config.json` / `config.json`: the eos ids that end generation.

Chat templates render in a sandboxed Jinja environment configured as transformers does
(trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps unicode).
Templates usually start with the bos token themselves, so a rendered chat prompt is encoded with
`add_special_tokens=False`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from meshlm.common.context_length import completion_too_long, prompt_too_long

# config.json keys that give the context length, most specific first (as vLLM reads them).
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
)
# tokenizer_config's model_max_length is a huge sentinel (1e30) when unset.
_SANE_MAX_LEN = 10_000_000


class TextTokenizer:
    """One checkpoint's tokenizer, chat template, context length and eos ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        model_path: Path,
        max_model_len: int,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Prefer `from_pretrained`. `add_bos_token=None` leaves BOS to the post-processor."""
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self._model_path = model_path
        self._max_model_len = max_model_len
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._pad_token = pad_token
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos_ids = list(eos_token_ids)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        self._eos_ids = list(dict.fromkeys(eos_ids))  # dedup, keep order
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        self._chat_template = chat_template
        self._fix_bos = self._bos_fixup(add_bos_token)

    @classmethod
    def from_pretrained(cls, path: str | Path, max_model_len: int | None = None) -> TextTokenizer:
        """Load from an HF-layout directory; `max_model_len` overrides the checkpoint's."""
        model_path = Path(path)
        tok_file = model_path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{model_path}: no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tok_file))
        tok_cfg = _read_json(model_path / "tokenizer_config.json")
        model_cfg = _read_json(model_path / "config.json")
        gen_cfg = _read_json(model_path / "generation_config.json")

        if max_model_len is None:
            max_model_len = _context_length(model_cfg, tok_cfg)
        if max_model_len is None:
            raise ValueError(
                f"{model_path}: no context length in config.json or tokenizer_config.json; "
                "pass max_model_len"
            )
        eos_ids = _id_list(gen_cfg.get("eos_token_id")) + _id_list(model_cfg.get("eos_token_id"))
        template_file = model_path / "chat_template.jinja"
        template = _pick_template(tok_cfg.get("chat_template"))
        if template is None and template_file.is_file():
            template = template_file.read_text()
        add_bos = tok_cfg.get("add_bos_token")
        return cls(
            tokenizer,
            model_path=model_path,
            max_model_len=int(max_model_len),
            bos_token=_token_content(tok_cfg.get("bos_token")),
            eos_token=_token_content(tok_cfg.get("eos_token")),
            pad_token=_token_content(tok_cfg.get("pad_token")),
            eos_token_ids=eos_ids,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            chat_template=template,
        )

    # -- encode / decode -------------------------------------------------------------------

    def encode_batch(self, texts: Sequence[str | tuple[str, str]],
                     add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, or of each (text, text_pair) pair joined by the tokenizer's
        pair template (transformers' tokenizer(text, text_pair)). Runs in Rust, in parallel,
        without the GIL."""
        encodings = self._tok.encode_batch_fast(list(texts),
                                                add_special_tokens=add_special_tokens)
        batch = [e.ids for e in encodings]
        if add_special_tokens and self._fix_bos is not None:
            batch = [self._fix_bos(ids) for ids in batch]
        return batch

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text."""
        return self.encode_batch([text], add_special_tokens)[0]

    def word_ids(self, words: Sequence[str]) -> list[list[int]]:
        """vLLM's bad_words encoded: each word's ids as it starts a text and, where after a
        space it is other tokens of the same number, those too (one encode_batch call)."""
        bare = [w.lstrip() for w in words]
        encoded = self.encode_batch(bare + [" " + w for w in bare], add_special_tokens=False)
        alone, spaced = encoded[:len(bare)], encoded[len(bare):]
        out = []
        for first, second in zip(alone, spaced, strict=True):
            out.append(first)
            if second and second[0] != first[0] and len(second) == len(first):
                out.append(second)
        return out

    def count(self, text: str) -> int:
        """How many tokens one text has, special tokens left out (no id list is built)."""
        return len(self._tok.encode_batch_fast([text], add_special_tokens=False)[0])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of a whole id sequence (for streaming, use the detokenizer's incremental one)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        template: str = "",
    ) -> str:
        """Render a conversation to a prompt string with the checkpoint's chat template (or
        `template`, the request's own: ChatTemplateError when it is not valid Jinja).

        `template_kwargs`: more variables for the template (a client's chat_template_kwargs,
        e.g. enable_thinking), checked by `checked_template_kwargs` first.

        `continue_final_message`: the last message is left open for the model to continue,
        the rendering cut just after its content (see `_open_final_message`); it cannot be
        combined with `add_generation_prompt`.

        Raises ValueError when the checkpoint has no template, the template rejects the
        messages (its `raise_exception(...)` or a Jinja error), or the final message cannot
        be continued.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        source = template or self._chat_template
        if source is None:
            raise ValueError(
                f"the model at {self._model_path} has no chat template; "
                "send a plain text prompt instead"
            )
        try:
            compiled = _compile(source)
        except TemplateError as e:
            raise ChatTemplateError(f"not a valid chat template: {e}") from e
        try:
            text: str = compiled.render(
                **(template_kwargs or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
                pad_token=self._pad_token or "",
            )
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise ValueError(f"the chat template failed: {e}") from e
        return _open_final_message(text, messages) if continue_final_message else text

    # -- checks -----------------------------------------------------------------------------

    def check_context(
        self, prompt_len: int, max_new_tokens: int, *, prompt_field: str = "text",
        logprob_start_len: int = -1, limit: int = 0,
    ) -> str | None:
        """None if the request fits the context; else a client-facing message naming the field.

        `prompt_field` is the request field the prompt came from ("text", "input_ids", ...).
        `logprob_start_len` (prompt logprobs asked from there; -1 = none) must be a prompt
        position. `limit`: the context length to check against when smaller than the
        checkpoint's (the engine's, as the gateway knows it); 0 = the checkpoint's.
        """
        limit = self.context_length(limit)
        if prompt_len <= 0:
            return f"{prompt_field}: the prompt is empty (0 tokens)"
        if prompt_len >= limit:  # no room left to generate
            return prompt_too_long(prompt_field, prompt_len, limit)
        if max_new_tokens < 0:
            return f"sampling_params.max_new_tokens: must be >= 0, got {max_new_tokens}"
        if prompt_len + max_new_tokens > limit:
            return completion_too_long(prompt_len, max_new_tokens, limit)
        if logprob_start_len >= prompt_len:
            return (
                f"logprob_start_len: must be less than the prompt's length ({prompt_len} tokens), "
                f"got {logprob_start_len}"
            )
        return None

    def context_length(self, limit: int = 0) -> int:
        """The context length a request is held to: `limit` (the engine's, from the gateway)
        when it is smaller than the checkpoint's; 0 = the checkpoint's."""
        return min(limit, self._max_model_len) if limit > 0 else self._max_model_len

    # -- properties -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The raw `tokenizers.Tokenizer` (for the incremental detokenizer)."""
        return self._tok

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens must fit in this many positions."""
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary, added tokens included (the model's may be padded larger)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: generation_config's, config's, then the tokenizer's eos."""
        return list(self._eos_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (dropped by skip_special_tokens)."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # -- helpers ----------------------------------------------------------------------------

    def _bos_fixup(self, add_bos_token: bool | None) -> Callable[[list[int]], list[int]] | None:
        """Make add_special_tokens honour an explicit add_bos_token, as transformers does."""
        bos = self._bos_id
        if add_bos_token is None or bos is None:
            return None
        probe = self._tok.encode("a", add_special_tokens=True).ids
        post_adds_bos = bool(probe) and probe[0] == bos
        if add_bos_token and not post_adds_bos:
            return lambda ids: ids if ids[:1] == [bos] else [bos, *ids]
        if not add_bos_token and post_adds_bos:
            return lambda ids: ids[1:] if ids[:1] == [bos] else ids
        return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _context_length(model_cfg: dict[str, Any], tok_cfg: dict[str, Any]) -> int | None:
    for cfg in (model_cfg, model_cfg.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    value = tok_cfg.get("model_max_length")
    if isinstance(value, int | float) and 0 < value < _SANE_MAX_LEN:
        return int(value)
    return None


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """`text` (a conversation rendered without a generation prompt) cut just after the final
    message's content, so that whatever the template writes to close the message is gone and
    generation continues that message (as transformers' `continue_final_message` does). A
    template may trim the content: it is looked for stripped, and its trailing whitespace is
    kept only where the template kept it."""
    final = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not write the final message's "
            "content verbatim, so it cannot be continued"
        )
    kept = final.lstrip()
    if text[at : at + len(kept)] != kept:
        kept = final.strip()
    return text[: at + len(kept)]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


class ChatTemplateError(ValueError):
    """A request's own chat template that does not compile."""


@functools.lru_cache(maxsize=32)  # the checkpoint's, and the requests' latest own ones
def _compile(source: str) -> Any:
    return _ENV.from_string(source)
