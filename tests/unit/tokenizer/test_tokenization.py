"""TextTokenizer on the default model and on Llama-3/Qwen2-style HF checkpoint files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from meshlm.common.default_model import ensure_default_model
from meshlm.common.errors import MeshError
from meshlm.tokenizer.chats import render_chat
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.v1 import tokenizer_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_pretrained(model_dir)


def _copy_checkpoint(src: Path, dst: Path, **tok_cfg_changes: Any) -> Path:
    """A checkpoint dir with the default tokenizer.json and edited configs (no weights)."""
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    for key, value in tok_cfg_changes.items():
        if value is None:
            tok_cfg.pop(key, None)
        else:
            tok_cfg[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dst


def test_properties_of_the_default_model(tok: TextTokenizer, model_dir: Path) -> None:
    raw = tok.tokenizer
    assert tok.model_path == model_dir
    assert tok.max_model_len == 2048
    assert tok.vocab_size == 2048
    assert tok.bos_token_id == raw.token_to_id("<|begin_of_text|>")
    assert tok.eos_token_ids == [raw.token_to_id("<|im_end|>"), raw.token_to_id("<|end_of_text|>")]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert tok.special_token_ids == {raw.token_to_id(t) for t in specials}


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "naïve café — déjà vu; Ελληνικά; Русский текст",
        "日本語のテキストと中文字符，한국어도",
        "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 and ZWJ",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n\n\n",
        "\u0000\u0001 control \ufffd replacement \U0010ffff",
        "",
    ],
)
def test_round_trip(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text  # special-token text included


def test_encode_batch_matches_encode(tok: TextTokenizer) -> None:
    texts = ["one", "two words", "", "三 😀"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, add_special_tokens=False) == [
        tok.encode(t, add_special_tokens=False) for t in texts
    ]
    assert tok.encode_batch([]) == []


def test_encode_batch_pairs_use_the_pair_template(tok: TextTokenizer) -> None:
    """A (text, text_pair) pair is encoded as transformers' tokenizer(text, text_pair): here
    the default model's template puts a bos before each part."""
    raw = tok.tokenizer
    [single, pair] = tok.encode_batch(["query", ("query", "a document")])
    assert single == tok.encode("query")
    assert pair == raw.encode("query", "a document").ids
    bos = tok.bos_token_id
    assert pair == [bos, *tok.encode("query", False), bos, *tok.encode("a document", False)]


def test_special_token_text_becomes_one_token(tok: TextTokenizer) -> None:
    ids = tok.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "user"


def test_chat_template(tok: TextTokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there! "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    body = (
        "<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages) == body + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    prompt_tail = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(prompt_tail) :] == prompt_tail
    assert prompt_tail[0] == tok.tokenizer.token_to_id("<|im_start|>")


def test_a_requests_own_chat_template(tok: TextTokenizer) -> None:
    """Rendered in the same sandbox, with the same variables; one that does not compile is
    refused under chat_template, one that fails on the messages under messages."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    own = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ bos_token }}"
    assert tok.apply_chat_template(messages, template=own) == "[user:Hi][assistant:Yo]" + (
        tok.apply_chat_template([], template="{{ bos_token }}"))
    chat = tokenizer_pb2.ChatTemplateRequest(messages_json=json.dumps(messages),
                                             chat_template="{% for m in messages %}")
    with pytest.raises(MeshError, match="^chat_template: not a valid chat template"):
        render_chat(tok, chat)
    chat.chat_template = "{{ raise_exception('no assistant turns') }}"
    with pytest.raises(MeshError, match="^messages: .*no assistant turns"):
        render_chat(tok, chat)
    chat.chat_template = "{{ ''.__class__.__mro__ }}"  # the sandbox holds
    with pytest.raises(MeshError, match="^messages: "):
        render_chat(tok, chat)


def test_template_kwargs_are_the_templates_variables(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_checkpoint(model_dir, tmp_path / "a", chat_template=(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"))
    tok = TextTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == "Hi"
    assert tok.apply_chat_template(messages, template_kwargs={"enable_thinking": True}) == "Hi"
    assert tok.apply_chat_template(messages, template_kwargs={"enable_thinking": False}) == \
        "Hi/no_think"


def test_a_chats_tools_and_earlier_calls_reach_the_template(model_dir: Path,
                                                         tmp_path: Path) -> None:
    """The request's tools are the template's `tools` (a client's chat_template_kwargs may
    not set them); earlier tool calls and tool results are messages it reads."""
    path = _copy_checkpoint(model_dir, tmp_path / "a", chat_template=(
        "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
        "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "call {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{% elif m.role == 'tool' %}<{{ m.tool_call_id }}:{{ m.content }}>"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"))
    servicer_tok = TextTokenizer.from_pretrained(path)
    chat = tokenizer_pb2.ChatTemplateRequest(
        messages_json=json.dumps([
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]),
        tools_json=json.dumps([{"type": "function", "function": {"name": "get_weather"}},
                               {"type": "function", "function": {"name": "get_time"}}]))
    assert render_chat(servicer_tok, chat) == \
        "[get_weather;get_time;]Weather?call get_weather(Rome)<c1:sunny>"
    with pytest.raises(MeshError, match="chat_template_kwargs.tools: is set by the server"):
        render_chat(servicer_tok, tokenizer_pb2.ChatTemplateRequest(
            messages_json=chat.messages_json, template_kwargs_json='{"tools": []}'))


def test_continue_final_message_leaves_it_open(tok: TextTokenizer, model_dir: Path,
                                                tmp_path: Path) -> None:
    """The rendering ends just after the final message's content (transformers' rule): what
    closes the message is cut; trailing spaces stay only where the template kept them."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once "}]
    opened = tok.apply_chat_template(messages, add_generation_prompt=False,
                                     continue_final_message=True)
    # The default ChatML template trims contents.
    assert opened == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n" \
                     "<|im_start|>assistant\nOnce"
    verbatim = _copy_checkpoint(model_dir, tmp_path / "a", chat_template=(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"))
    plain = TextTokenizer.from_pretrained(verbatim)
    assert plain.apply_chat_template(messages, False, True) == "<user>Hi</user><assistant>Once "
    with pytest.raises(ValueError, match="cannot both be set"):
        tok.apply_chat_template(messages, add_generation_prompt=True,
                                continue_final_message=True)
    with pytest.raises(ValueError, match="needs a final message with text"):
        tok.apply_chat_template([*messages[:1], {"role": "assistant", "content": " "}],
                                False, True)
    upper = _copy_checkpoint(model_dir, tmp_path / "b", chat_template=(
        "{% for m in messages %}{{ m.content | upper }}{% endfor %}"))
    with pytest.raises(ValueError, match="does not write the final message"):
        TextTokenizer.from_pretrained(upper).apply_chat_template(messages, False, True)


def test_check_context(tok: TextTokenizer) -> None:
    assert tok.check_context(10, 100) is None
    assert tok.check_context(2000, 48) is None
    assert tok.check_context(2047, 1) is None
    assert tok.check_context(0, 10) == "text: the prompt is empty (0 tokens)"
    assert tok.check_context(3000, 10) == (
        "text: the prompt is 3000 tokens, which is longer than the model's context length "
        "(2048 tokens); shorten the prompt"
    )
    assert tok.check_context(2048, 0) == (
        "text: the prompt is 2048 tokens, which is longer than the model's context length "
        "(2048 tokens); shorten the prompt"
    )
    assert tok.check_context(2000, 100) == (
        "sampling_params.max_new_tokens: max_new_tokens is too large: 100. Requested token "
        "count exceeds the model's maximum context length of 2048 tokens (2000 prompt + 100 "
        "completion tokens); use at most 48"
    )
    assert tok.check_context(5000, 1, prompt_field="input_ids") == (
        "input_ids: the prompt is 5000 tokens, which is longer than the model's context length "
        "(2048 tokens); shorten the prompt"
    )
    # The engine's context length, when the gateway gives a smaller one.
    assert tok.check_context(1500, 10, limit=1024).startswith(  # type: ignore[union-attr]
        "text: the prompt is 1500 tokens, which is longer than the model's context length "
        "(1024 tokens)")
    assert tok.check_context(1000, 10, limit=4096) is None  # never more than the checkpoint's
    assert tok.check_context(2047, 1, limit=4096) is None
    message = tok.check_context(10, -1)
    assert message is not None and message.startswith("sampling_params.max_new_tokens:")
    # Prompt logprobs must start inside the prompt.
    assert tok.check_context(10, 5, logprob_start_len=9) is None
    assert tok.check_context(10, 5, logprob_start_len=-1) is None
    assert tok.check_context(10, 5, logprob_start_len=10) == (
        "logprob_start_len: must be less than the prompt's length (10 tokens), got 10"
    )


def test_max_model_len_override(model_dir: Path) -> None:
    tok = TextTokenizer.from_pretrained(model_dir, max_model_len=100)
    assert tok.max_model_len == 100
    assert tok.check_context(101, 0) is not None


def test_hf_style_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    """AddedToken dicts, a list of named templates, eos ids from several files, Qwen2 style."""
    path = _copy_checkpoint(
        model_dir,
        tmp_path / "ckpt",
        bos_token=None,
        add_bos_token=None,
        eos_token={"content": "<|end_of_text|>", "special": True},
        pad_token={"content": "<|pad|>", "lstrip": False},
        chat_template=[
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
        ],
    )
    (path / "config.json").write_text(json.dumps({"max_seq_len": 512, "eos_token_id": 3}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 0]}))
    tok = TextTokenizer.from_pretrained(path)
    assert tok.max_model_len == 512
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == [3, 0, tok.tokenizer.token_to_id("<|end_of_text|>")]
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"


def test_chat_template_file_and_missing_template(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_checkpoint(model_dir, tmp_path / "a", chat_template=None)
    tok = TextTokenizer.from_pretrained(path)  # max_model_len from model_max_length
    assert tok.max_model_len == 2048
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
    (path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = TextTokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "<|begin_of_text|>a"


def test_template_errors_become_value_errors(model_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages | tojson }}"
    )
    path = _copy_checkpoint(model_dir, tmp_path / "a", chat_template=template)
    tok = TextTokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '[{"role": "user", "content": "é"}]'
    )
    with pytest.raises(ValueError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    broken = _copy_checkpoint(model_dir, tmp_path / "b", chat_template="{% for %}")
    with pytest.raises(ValueError, match="chat template"):
        TextTokenizer.from_pretrained(broken).apply_chat_template([])


def test_add_bos_token_overrides_post_processor(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_checkpoint(model_dir, tmp_path / "a", add_bos_token=False)
    tok = TextTokenizer.from_pretrained(path)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)

    path = _copy_checkpoint(model_dir, tmp_path / "b", add_bos_token=True)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    raw.post_processor = None
    raw.save(str(path / "tokenizer.json"))
    tok = TextTokenizer.from_pretrained(path)
    assert tok.encode_batch(["hi", ""]) == [[tok.bos_token_id, *tok.encode("hi", False)], [0]]


def test_saved_truncation_and_padding_are_ignored(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_checkpoint(model_dir, tmp_path / "a")
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    raw.enable_truncation(4)
    raw.enable_padding(length=64)
    raw.save(str(path / "tokenizer.json"))
    tok = TextTokenizer.from_pretrained(path)
    text = "a sentence that is much longer than four tokens"
    assert tok.decode(tok.encode(text)) == text


def test_missing_files(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.from_pretrained(tmp_path)
    path = _copy_checkpoint(model_dir, tmp_path / "a", model_max_length=int(1e30))
    with pytest.raises(ValueError, match="max_model_len"):
        TextTokenizer.from_pretrained(path)
    assert TextTokenizer.from_pretrained(path, max_model_len=64).max_model_len == 64


def test_bad_words_are_encoded_alone_and_after_a_space_where_that_differs() -> None:
    tok = TextTokenizer.from_pretrained(ensure_default_model())
    words = tok.word_ids(["hello", " world"])
    alone, spaced = tok.encode("hello", False), tok.encode(" hello", False)
    assert words[0] == alone
    assert (spaced in words) == (spaced[0] != alone[0] and len(spaced) == len(alone))
    assert tok.encode("world", False) in words  # a word's own leading space is dropped first
