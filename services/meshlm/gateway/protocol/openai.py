"""OpenAI request bodies -> what the gateway runs. Pure: no I/O.

`parse_chat`, `parse_completion` and `parse_embedding` check an OpenAI JSON body field by field
(types, OpenAI's ranges, options meshlm does not serve) and raise INVALID_ARGUMENT naming the
field as the client wrote it. A generation request becomes public SglangService requests
(`public_request`: TextGenerateRequest for a text prompt, GenerateRequest for token ids), so
the gateway's own validation (`protocol/validation.py`) checks the rest exactly as for SGLang's
API; its messages are put back into OpenAI's names with `names`. The typed field reads are
`protocol/json_body.py`'s.

Accepted beside OpenAI's fields (as SGLang and vLLM accept them): top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, skip_special_tokens, stop_token_ids, rid (vLLM's
request_id), priority (SGLang's order: larger first), no_stop_trim (vLLM's
include_stop_str_in_output: a matched stop string stays in the text) and vLLM's
allowed_token_ids, bad_words, return_token_ids (the output's and the prompt's ids in the
answer), return_tokens_as_token_ids (logprobs name tokens
"token_id:<id>"), logprob_token_ids (each position lists the chosen token and these, in place
of the most likely ones), prompt_logprobs (not streaming), truncate_prompt_tokens with
truncation_side (the prompt's ids cut to fit, the last ones kept by default), and
use_beam_search: false and length_penalty (beam search's, no effect without it; true is
UNIMPLEMENTED), spaces_between_special_tokens (slow tokenizers', no effect); on chat, vLLM's
add_generation_prompt, continue_final_message (the last message left open and continued; not
with add_generation_prompt: true, which is otherwise the default), echo (the reply starts with
the last message's content when that message is the assistant's), chat_template_kwargs (the
template's own variables; OpenAI's reasoning_effort and vLLM's documents become template
variables too), tools and tool_choice (`tool_calls.py`), and the reasoning
switches SGLang's separate_reasoning and stream_reasoning and vLLM's include_reasoning (with
the gateway's reasoning parser). Constrained decoding, by OpenAI's
response_format (json_object, json_schema), SGLang's regex, ebnf and json_schema, or vLLM's
structured_outputs and guided_* fields (one of them), becomes the public request's
guided_decoding (`protocol/constraints.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from meshlm.common.chat_variables import FIELD as TEMPLATE_KWARGS
from meshlm.common.chat_variables import checked_template_kwargs
from meshlm.common.errors import invalid
from meshlm.gateway.protocol.constraints import openai_constraint, set_guided
from meshlm.gateway.protocol.json_body import MAX_PROMPT_IDS as MAX_PROMPT_IDS
from meshlm.gateway.protocol.json_body import JsonBody, is_ids, is_int, show
from meshlm.gateway.protocol.logprob_options import MAX_TOP_LOGPROBS
from meshlm.gateway.protocol.openai_errors import MAX_NEW_TOKENS
from meshlm.gateway.protocol.tool_calls import (
    ToolChoice,
    checked_message_calls,
    parse_tools,
    template_messages,
)
from meshlm.gateway.protocol.validation import MAX_N, unimplemented
from meshlm.v1 import tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

MAX_PROMPTS = 64          # prompts or inputs in one completions / embeddings request
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CACHE_SALT = 1024  # characters: a tenant's key, not a payload
_INT32 = 2**31 - 1
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

Prompt = str | list[int]


@dataclass
class GenerationRequest:
    """A chat or completions request in the gateway's terms."""

    model: str | None
    sampling: pb.SamplingParams  # public params; max_new_tokens unset when the client gave none
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs; else alternatives per token (0 = none)
    rid: str | None
    names: dict[str, str] = field(default_factory=dict)  # gateway field -> the client's
    priority: int | None = None
    continuous_usage: bool = False  # the usage so far in every streamed chunk
    return_token_ids: bool = False  # vLLM's: output and prompt ids in the answer
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:<id>" in logprobs
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs, with this many top ones
    truncate: int | None = None  # vLLM's truncate_prompt_tokens (-1: the context length)
    truncate_right: bool = False  # vLLM's truncation_side "right": the first ones kept
    logprob_ids: list[int] = field(default_factory=list)  # vLLM's logprob_token_ids
    cache_salt: str = ""  # vLLM's: prefix-cache reuse only among requests with the same salt
    thinking_budget: int | None = None  # vLLM's thinking_token_budget: SGLang's max_thinking_tokens
    budget_if_read: bool = False  # the budget only where the gateway has a reasoning parser

    @property
    def n(self) -> int:
        return self.sampling.n if self.sampling.HasField("n") else 1


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str = ""  # vLLM's: the request's own template ("": the checkpoint's)
    add_special_tokens: bool = False  # vLLM's: the tokenizer's bos on top of the template's
    tools: list[dict[str, Any]] | None = None  # for the template
    tool_choice: ToolChoice | None = None  # how the tools may be called (None: not)
    separate_reasoning: bool = True  # SGLang's: the thinking apart (with a reasoning parser)
    stream_reasoning: bool = True  # SGLang's: the thinking streamed as it comes
    include_reasoning: bool = True  # vLLM's: the thinking returned at all

    @property
    def echo_text(self) -> str | None:
        """What the reply starts with (`echo`): the last message's content when it is the
        assistant's, the role the reply is in."""
        last = self.messages[-1]
        if not self.echo or last["role"] != "assistant" or not last["content"]:
            return None
        return str(last["content"])


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[Prompt] = field(default_factory=list)
    batch: bool = False  # the prompt was a list of prompts
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: for text prompts (token ids are sent as given)


@dataclass
class EmbeddingRequest:
    model: str | None
    inputs: list[Prompt]
    base64: bool  # encoding_format "base64": little-endian float32 bytes


# ---- generation ------------------------------------------------------------------------------


def _sampling(body: JsonBody, max_tokens_key: str) -> tuple[pb.SamplingParams, dict[str, str]]:
    """The sampling fields shared by chat and completions, as public SamplingParams (ranges
    beyond OpenAI's own are left to the gateway's validation), and the client's field names."""
    p = pb.SamplingParams()
    names: dict[str, str] = {}
    temperature = body.number("temperature")
    if temperature is not None:
        if not 0 <= temperature <= 2:
            raise invalid("temperature", f"must be in [0, 2], got {temperature:g}")
        p.temperature = temperature
    for key in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = body.number(key)
        if value is not None:
            setattr(p, key, value)
    top_k = body.integer("top_k", -1, _INT32)
    if top_k is not None:
        p.top_k = top_k
    max_tokens = body.integer(max_tokens_key, 1, _INT32)
    if max_tokens is not None:
        p.max_new_tokens = max_tokens
    names[MAX_NEW_TOKENS] = max_tokens_key
    min_tokens = body.integer("min_tokens", 0, _INT32)
    if min_tokens is not None:
        p.min_new_tokens = min_tokens
        names["sampling_params.min_new_tokens"] = "min_tokens"
    n = body.integer("n", 1, MAX_N)
    if n is not None:
        p.n = n
    seed = body.integer("seed", 0, 2**63 - 1)
    if seed is not None:
        p.seed = seed
    p.stop.extend(_stop(body.get("stop")))
    words = body.get("bad_words")  # vLLM's
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise invalid("bad_words", "must be a list of strings")
        p.bad_words.extend(words)
    for key in ("stop_token_ids", "allowed_token_ids"):  # the second is vLLM's
        ids = body.get(key)
        if ids is not None:
            if not isinstance(ids, list) or not all(is_int(t) and 0 <= t <= _INT32 for t in ids):
                raise invalid(key, "must be a list of token ids")
            getattr(p, key).extend(ids)
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        flag = body.boolean(key)
        if flag is not None:
            setattr(p, key, flag)
    if body.boolean("include_stop_str_in_output"):  # vLLM's name
        p.no_stop_trim = True
    _logit_bias(p, body.get("logit_bias"))
    openai_constraint(body, p, names)
    if body.get("lora_path") is not None:  # SGLang's
        raise unimplemented("lora_path", "LoRA adapters are not supported: one set of weights")
    return p, names


def _logit_bias(p: pb.SamplingParams, value: Any) -> None:
    """OpenAI's {"<token id>": bias}; the ranges are the gateway's validation's."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("logit_bias", "must be an object of token ids and biases, such as "
                                    '{"42": -100}')
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) > _INT32:
            raise invalid("logit_bias", f"{show(key)} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise invalid("logit_bias", f"the bias of token {key} must be a number, "
                                        f"got {show(bias)}")
        p.logit_bias[int(key)] = bias


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise invalid("stop", "must be a string or a list of strings")


def _stream(body: JsonBody) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage): vLLM's continuous_usage_stats puts the usage
    so far in every chunk, with include_usage."""
    stream = bool(body.boolean("stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        flag = options.get(key, False)
        if not isinstance(flag, bool):
            raise invalid(f"stream_options.{key}", "must be true or false")
        flags.append(flag)
    return stream, flags[0], flags[0] and flags[1]


def _vllm_options(b: JsonBody, stream: bool) -> dict[str, Any]:
    """vLLM's return_token_ids, return_tokens_as_token_ids, prompt_logprobs,
    truncate_prompt_tokens, truncation_side, cache_salt and thinking_token_budget, as
    GenerationRequest fields.
    prompt_logprobs come in the whole answer only: refused with stream, but 0 is taken there
    and changes nothing, as in vLLM."""
    k = b.integer("prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    if k is not None and stream:
        if k:
            raise invalid("prompt_logprobs", "is not available when stream is true")
        k = None
    truncate = b.integer("truncate_prompt_tokens", -1, _INT32)
    if truncate == 0:
        raise invalid("truncate_prompt_tokens", "must be -1 (max_model_len) or at least 1, got 0")
    if b.boolean("use_beam_search"):
        raise unimplemented("use_beam_search", "beam search is not supported; draw n samples "
                                               "instead")
    b.number("length_penalty")  # beam search's alone: no effect without it, as in vLLM
    # Slow (Python) tokenizers' alone: fast ones, the only kind meshlm loads, never put spaces
    # between special tokens, as in vLLM with a fast tokenizer.
    b.boolean("spaces_between_special_tokens")
    side = b.string("truncation_side")
    if side not in (None, "left", "right"):
        raise invalid("truncation_side", f"must be \"left\" or \"right\", got {show(side)}")
    salt = b.string("cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT:
        raise invalid("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT} "
                                    f"characters, got {len(salt)}")
    return {"cache_salt": salt or "",
            "thinking_budget": b.integer("thinking_token_budget", 0, _INT32),
            "return_token_ids": bool(b.boolean("return_token_ids")),
            "tokens_as_ids": bool(b.boolean("return_tokens_as_token_ids")),
            "prompt_logprobs": k, "truncate": truncate, "truncate_right": side == "right",
            "logprob_ids": _logprob_ids(b.get("logprob_token_ids"))}


def _rid(b: JsonBody, names: dict[str, str]) -> str | None:
    """SGLang's rid, or vLLM's request_id (the same: the answer's id is "chatcmpl-<id>" or
    "cmpl-<id>" either way); not both."""
    rid, request_id = b.string("rid"), b.string("request_id")
    if request_id is None:
        return rid
    if rid is not None:
        raise invalid("request_id", "give rid or request_id, not both")
    names["rid"] = "request_id"
    return request_id


def _logprob_ids(value: Any) -> list[int]:
    """vLLM's logprob_token_ids: the ids whose logprobs each position lists (with logprobs)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) and 0 <= t <= _INT32 for t in value):
        raise invalid("logprob_token_ids", "must be a list of token ids")
    if not value:
        raise invalid("logprob_token_ids", "must not be an empty list")
    if len(value) > MAX_TOP_LOGPROBS:
        raise invalid("logprob_token_ids", f"at most {MAX_TOP_LOGPROBS} ids, got {len(value)}")
    return value


def _vllm_names(options: dict[str, Any], logprobs: bool, names: dict[str, str]) -> None:
    """vLLM's options under the gateway's names, in the client's words: the thinking budget,
    and logprob_token_ids (which lists its ids in the logprobs: it needs them asked for)."""
    names["max_thinking_tokens"] = "thinking_token_budget"
    if options["logprob_ids"]:
        if not logprobs:
            raise invalid("logprob_token_ids", "needs logprobs to be set")
        names["token_ids_logprob"] = "logprob_token_ids"


def chat_rendering(add_generation_prompt: bool | None,
                   continue_final_message: bool) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as vLLM settles them: the generation
    prompt by default, not when the final message is continued; both at once is refused."""
    if continue_final_message and add_generation_prompt:
        raise invalid("continue_final_message", "cannot be combined with "
                                                "add_generation_prompt: true")
    if add_generation_prompt is None:
        return not continue_final_message, continue_final_message
    return add_generation_prompt, continue_final_message


def parse_chat(body: bytes) -> ChatRequest:
    b = JsonBody(body)
    model = b.string("model")
    messages = _messages(b.get("messages"))
    # max_completion_tokens is the current name, max_tokens the deprecated one (ignored when
    # both are given).
    given = b.doc.get("max_completion_tokens") is not None
    key = "max_completion_tokens" if given else "max_tokens"
    b.read.update(("max_tokens", "max_completion_tokens"))
    sampling, names = _sampling(b, key)
    stream, include_usage, continuous = _stream(b)
    logprobs = b.boolean("logprobs")
    top = b.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    names.update({"top_logprobs_num": "top_logprobs", "input_ids": "messages"})
    tools, tool_choice = parse_tools(b)
    if tool_choice is not None and tool_choice.schema is not None:
        _force_call(sampling, names, tool_choice.schema, tool_choice.schema_field)
    b.unsupported("modalities", " (text only)", (["text"],))
    add_prompt, continue_final = chat_rendering(b.boolean("add_generation_prompt"),
                                                bool(b.boolean("continue_final_message")))
    echo = bool(b.boolean("echo"))
    if echo and tool_choice is not None and not tool_choice.auto:
        raise invalid("echo", "cannot be combined with a tool_choice that forces a call (the "
                              "reply is its tool calls, not text)")
    rid = _rid(b, names)
    priority = b.integer("priority", -_INT32 - 1, _INT32)
    kwargs = _template_variables(b, checked_template_kwargs(b.get(TEMPLATE_KWARGS)))
    template = b.string("chat_template") or ""
    special = bool(b.boolean("add_special_tokens"))
    # The reasoning switches (with the gateway's --reasoning-parser; without one they change
    # nothing, as in SGLang and vLLM): SGLang's separate_reasoning (false: the thinking stays
    # in the content) and stream_reasoning (false: it comes whole), vLLM's include_reasoning
    # (false: it is dropped).
    separate = b.boolean("separate_reasoning") is not False
    stream_thinking = b.boolean("stream_reasoning") is not False
    include = b.boolean("include_reasoning") is not False
    vllm = _vllm_options(b, stream)
    _vllm_names(vllm, bool(logprobs), names)
    b.check_unknown()
    return ChatRequest(model=model, sampling=sampling, stream=stream,
                       include_usage=include_usage, top_logprobs=(top or 0) if logprobs else None,
                       rid=rid, names=names, priority=priority, continuous_usage=continuous,
                       messages=messages,
                       add_generation_prompt=add_prompt,
                       continue_final_message=continue_final, echo=echo,
                       template_kwargs=kwargs, chat_template=template,
                       add_special_tokens=special, tools=tools,
                       tool_choice=tool_choice, separate_reasoning=separate,
                       stream_reasoning=stream_thinking, include_reasoning=include, **vllm)


def _template_variables(b: JsonBody, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The chat template's variables from the request's own fields, as vLLM passes them:
    OpenAI's reasoning_effort (and enable_thinking: effort other than "none", unless
    chat_template_kwargs set it) and vLLM's documents (for retrieval templates)."""
    effort = b.string("reasoning_effort")
    documents = b.get("documents")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, "
                                              f"got {show(effort)}")
        kwargs = {"enable_thinking": effort != "none", **kwargs, "reasoning_effort": effort}
    if documents is not None:
        if not isinstance(documents, list) or not all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                for d in documents):
            raise invalid("documents", 'must be a list of objects of strings, such as '
                                       '{"title": ..., "text": ...}')
        kwargs = {**kwargs, "documents": documents}
    return kwargs


def _force_call(p: pb.SamplingParams, names: dict[str, str], schema: dict[str, Any],
                schema_field: str) -> None:
    """The output constrained to a forced call's JSON; no other constraint beside it."""
    if p.HasField("guided_decoding"):
        given = next((v for k, v in names.items() if k.startswith("sampling_params.guided")),
                     "a constraint")
        raise invalid("tool_choice", f"cannot be combined with {given}: a forced tool call "
                                     "constrains the output itself")
    set_guided(p, "json_schema", schema)
    names["sampling_params.guided_decoding.json_schema"] = schema_field
    names["sampling_params.grammar"] = schema_field  # the scheduler's word for it


def template_request(messages: list[Any], add_generation_prompt: bool,
                     continue_final_message: bool = False,
                     template_kwargs: dict[str, Any] | None = None,
                     add_special_tokens: bool = False,
                     tools: list[dict[str, Any]] | None = None, chat_template: str = ""
                     ) -> tokenizer_pb2.ChatTemplateRequest:
    """What the tokenizer renders a chat from (for a chat completion, and for /v1/tokenize);
    earlier tool calls' arguments go to the template as objects."""
    return tokenizer_pb2.ChatTemplateRequest(
        chat_template=chat_template,
        messages_json=orjson.dumps(template_messages(messages)).decode(),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs_json=orjson.dumps(template_kwargs).decode() if template_kwargs else "",
        add_special_tokens=add_special_tokens,
        tools_json=orjson.dumps(tools).decode() if tools else "")


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages with their content flattened to text (what chat templates expect)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(path, "must be an object with a role and content")
        role = message.get("role")
        if role not in _ROLES:
            raise invalid(f"{path}.role", f"must be one of {', '.join(_ROLES)}; got {show(role)}")
        checked_message_calls(message, path)
        flat = {**message, "role": role,
                "content": _content(message.get("content"), f"{path}.content"),
                **_earlier_reasoning(message, path)}
        out.append(flat)
    return out


def _earlier_reasoning(message: dict[str, Any], path: str) -> dict[str, str]:
    """An earlier answer's thinking, given as `reasoning` (vLLM's name) or `reasoning_content`
    (SGLang's), under both names for the chat template (Qwen3's and others' read
    `reasoning_content` to keep it in the conversation)."""
    given = {k: message[k] for k in ("reasoning", "reasoning_content")
             if message.get(k) is not None}
    for key, value in given.items():
        if not isinstance(value, str):
            raise invalid(f"{path}.{key}", f"must be a string, got {show(value)}")
    if not given:
        return {}
    text = given.get("reasoning_content", given.get("reasoning", ""))
    return {"reasoning": text, "reasoning_content": text}


def _content(content: Any, path: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(path, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid(f"{path}[{j}]", "only text parts ({\"type\": \"text\"}) are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{path}[{j}].text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


def parse_completion(body: bytes) -> CompletionRequest:
    b = JsonBody(body)
    model = b.string("model")
    prompts, batch = prompts_of(b.get("prompt"), "prompt")
    sampling, names = _sampling(b, "max_tokens")
    if not sampling.HasField("max_new_tokens"):
        sampling.max_new_tokens = COMPLETION_MAX_TOKENS
    stream, include_usage, continuous = _stream(b)
    logprobs = b.integer("logprobs", 0, MAX_TOP_LOGPROBS)
    names["top_logprobs_num"] = "logprobs"
    echo = bool(b.boolean("echo"))
    best_of = b.integer("best_of", 1, MAX_N)
    if best_of is not None and best_of != (sampling.n if sampling.HasField("n") else 1):
        raise invalid("best_of", "only best_of == n is supported")
    b.unsupported("suffix", "", ("",))
    rid = _rid(b, names)
    if rid is not None and batch:
        raise invalid(names.get("rid", "rid"), "give it only with a single prompt")
    priority = b.integer("priority", -_INT32 - 1, _INT32)
    special = b.boolean("add_special_tokens")
    vllm = _vllm_options(b, stream)
    _vllm_names(vllm, logprobs is not None, names)
    if echo and vllm["truncate"] is not None:
        raise invalid("echo", "cannot be combined with truncate_prompt_tokens (the prompt "
                              "echoed would not be the one computed)")
    b.check_unknown()
    return CompletionRequest(model=model, sampling=sampling, stream=stream,
                             include_usage=include_usage, top_logprobs=logprobs, rid=rid,
                             names=names, priority=priority, continuous_usage=continuous,
                             prompts=prompts, batch=batch, echo=echo,
                             add_special_tokens=special is not False, **vllm)


def prompts_of(value: Any, key: str) -> tuple[list[Prompt], bool]:
    """A prompt or input: a string, a list of strings, token ids, or a list of token id lists;
    returns the prompts and whether it was a list of them."""
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list) and value and is_ids(value, key):
        return [checked_ids(value, key)], False
    if not isinstance(value, list) or not value:
        raise invalid(key, "must be a string, a list of strings, a list of token ids or a "
                           "list of token id lists, and not empty")
    if len(value) > MAX_PROMPTS:
        raise invalid(key, f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(item)
        elif is_ids(item, f"{key}[{i}]"):
            prompts.append(checked_ids(item, f"{key}[{i}]"))
        else:
            raise invalid(f"{key}[{i}]", "must be a string or a list of token ids")
    return prompts, True


def checked_ids(ids: list[int], key: str) -> list[int]:
    if not all(0 <= t <= _INT32 for t in ids):
        raise invalid(key, "token ids must be in [0, 2**31)")
    return ids


def public_request(
    req: GenerationRequest, prompt: Prompt, max_new_tokens: int | None = None,
) -> pb.TextGenerateRequest | pb.GenerateRequest:
    """The public request for one prompt: its sampling params (with `max_new_tokens` when the
    client gave none), logprob options (the tokens' texts included; prompt logprobs from
    position 0 for an echoed completion and for prompt_logprobs, the top ones as many as the
    larger of the two asks), rid, priority and thinking budget."""
    sampling = pb.SamplingParams()
    sampling.CopyFrom(req.sampling)
    if max_new_tokens is not None and not sampling.HasField("max_new_tokens"):
        sampling.max_new_tokens = max_new_tokens
    out: pb.TextGenerateRequest | pb.GenerateRequest
    if isinstance(prompt, str):
        out = pb.TextGenerateRequest(text=prompt, sampling_params=sampling, stream=req.stream)
    else:
        out = pb.GenerateRequest(input_ids=prompt, sampling_params=sampling, stream=req.stream)
    top, prompt_top = req.top_logprobs, req.prompt_logprobs
    if top is not None or prompt_top is not None:
        out.return_logprob = True
        # The asked ids (logprob_token_ids) stand in for the most likely ones.
        out.top_logprobs_num = max(0 if req.logprob_ids else top or 0, prompt_top or 0)
        out.token_ids_logprob.extend(req.logprob_ids)
        out.return_text_in_logprobs = True
        if prompt_top is not None or (isinstance(req, CompletionRequest) and req.echo):
            out.logprob_start_len = 0
    if req.rid is not None:
        out.rid = req.rid
    if req.priority is not None:
        out.priority = req.priority
    if req.thinking_budget is not None:
        out.max_thinking_tokens = req.thinking_budget
    return out


# ---- embeddings ------------------------------------------------------------------------------


def parse_embedding(body: bytes) -> EmbeddingRequest:
    b = JsonBody(body)
    model = b.string("model")
    inputs, _ = prompts_of(b.get("input"), "input")
    fmt = b.string("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise invalid("encoding_format", f"must be \"float\" or \"base64\", got {show(fmt)}")
    b.unsupported("dimensions", " (embeddings have the model's size)")
    b.check_unknown()
    return EmbeddingRequest(model=model, inputs=inputs, base64=fmt == "base64")
