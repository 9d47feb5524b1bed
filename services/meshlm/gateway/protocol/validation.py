"""Request validation at the gateway: the only place a public request is checked.

Pure functions, no I/O. Every error is a MeshError whose message starts with the path of the
field at fault ("sampling_params.top_p: must be in (0, 1], got 1.5"), INVALID_ARGUMENT for a
bad value and UNIMPLEMENTED for a feature meshlm does not serve yet. Public sampling params
(all optional) become internal ones with every field concrete.

Text prompts are checked against the context length only after tokenization: the gateway calls
`check_prompt_length` with the prompt's token count (field "text"); the tokenizer checks
logprob_start_len against it the same way. Before that, their characters (`check_prompt_chars`)
and a call's number of requests (`check_batch`) are checked against the gateway's bounds
(`protocol/bounds.py`), so nothing that could never fit costs tokenization or a place in the mesh.

Logprob options (token_ids_logprob among them) are request-level in the public API; internally
they ride in the sampling params (`protocol/logprob_options.py`).

`sampling_params.n` (samples of one prompt, 1 to MAX_N) stays out of the internal params: the
gateway fans such a request out into n child requests (`protocol/choices.py`). max_new_tokens 0
asks for a prefill only (the prompt's logprobs, no token), as SGLang's. Embedding requests become a
ValidatedRequest with `embed` set and no output tokens (max_new_tokens 0).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import grpc

from meshlm.common.context_length import completion_too_long, prompt_too_long
from meshlm.common.errors import MeshError, invalid
from meshlm.gateway.protocol.constraints import grammar_of, think_first
from meshlm.gateway.protocol.logprob_options import GenerateLike, logprob_options
from meshlm.v1 import common_pb2, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2

DEFAULT_MAX_NEW_TOKENS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 16  # samples of one prompt (sampling_params.n)
MAX_LOGIT_BIAS = 1024  # token ids in one logit_bias
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary's ids
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
_RID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class Limits:
    """What the served model allows: context length (prompt + output) and vocabulary size;
    and the gateway's bounds: characters of a text prompt, requests of one call (0: unchecked),
    and its reasoning parser's tags."""

    max_model_len: int
    vocab_size: int
    max_prompt_chars: int = 0
    max_batch: int = 0
    # The reasoning parser's tags (opening, closing) for thinking budgets; None: no parser.
    thinking_tags: tuple[str, str] | None = None


@dataclass
class ValidatedRequest:
    """A generation or embedding request that passed validation; exactly one of text /
    input_ids / chat is set."""

    rid: str | None
    text: str | None
    input_ids: list[int] | None
    sampling: common_pb2.SamplingParams
    stream: bool
    return_text: bool
    routing_key: str | None
    trace_headers: dict[str, str] = field(default_factory=dict)
    n: int = 1  # samples of the prompt (child requests)
    dp_rank: int | None = None  # routed_dp_rank: the scheduler replica asked for
    embed: bool = False  # an embedding request
    text_pair: str | None = None  # with text: a cross-encoder's second text (rerank)
    session_id: str | None = None  # routing affinity when routing_key is not given
    priority: int = 0  # the scheduler's queue order: larger first (0 when not given)
    # An OpenAI chat, rendered and encoded by the tokenizer; fill_max_new_tokens: it gave no
    # max_tokens, so max_new_tokens is the room its prompt leaves (set there).
    chat: tokenizer_pb2.ChatTemplateRequest | None = None
    fill_max_new_tokens: bool = False
    add_special_tokens: bool = True  # a text prompt's, when encoded (a chat's: in `chat`)
    return_prompt_ids: bool = False  # the prompt's ids come back with the first output
    cache_salt: str = ""  # vLLM's: cached prefixes shared only among requests with this salt
    # vLLM's truncate_prompt_tokens: the tokenizer cuts the prompt's ids to this many (0: no
    # cut), keeping the last ones, or the first ones with truncate_right.
    truncate: int = 0
    truncate_right: bool = False


def unimplemented(field_path: str, problem: str) -> MeshError:
    return MeshError(grpc.StatusCode.UNIMPLEMENTED, f"{field_path}: {problem}")


def _num(x: float) -> str:
    return f"{x:.6g}"  # float32 fields: show 0.1, not 0.10000000149011612


def normalize_sampling(
    params: sglang_pb2.SamplingParams | None, *, field_prefix: str = "sampling_params"
) -> common_pb2.SamplingParams:
    """Check public sampling params and fill in defaults.

    top_k: -1 and 0 both mean "off" (SGLang uses -1, OpenAI-style clients send 0); the internal
    value is always -1 when off.
    """
    p = params if params is not None else sglang_pb2.SamplingParams()

    def name(f: str) -> str:
        return f"{field_prefix}.{f}"

    def get(f: str, default: float) -> float:
        return getattr(p, f) if p.HasField(f) else default

    temperature = get("temperature", 1.0)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise invalid(name("temperature"), f"must be a finite number >= 0, got {_num(temperature)}")
    top_p = get("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise invalid(name("top_p"), f"must be in (0, 1], got {_num(top_p)}")
    top_k = int(get("top_k", -1))
    if top_k < -1:
        raise invalid(name("top_k"), f"must be -1 or 0 (off) or >= 1, got {top_k}")
    min_p = get("min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise invalid(name("min_p"), f"must be in [0, 1], got {_num(min_p)}")
    penalties = {f: get(f, 0.0) for f in ("frequency_penalty", "presence_penalty")}
    for f, v in penalties.items():
        if not -2 <= v <= 2:
            raise invalid(name(f), f"must be in [-2, 2], got {_num(v)}")
    repetition_penalty = get("repetition_penalty", 1.0)
    if not 0 < repetition_penalty <= 2:
        raise invalid(
            name("repetition_penalty"), f"must be in (0, 2], got {_num(repetition_penalty)}"
        )
    max_new_tokens = int(get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    if max_new_tokens < 0:  # 0: prefill only
        raise invalid(name("max_new_tokens"), f"must be >= 0, got {max_new_tokens}")
    min_new_tokens = int(get("min_new_tokens", 0))
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise invalid(
            name("min_new_tokens"),
            f"must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}",
        )
    _check_stop(p, field_prefix)
    _check_logit_bias(p, field_prefix)
    if len(p.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise invalid(name("allowed_token_ids"), f"at most {MAX_ALLOWED_TOKEN_IDS} token ids, "
                                                 f"got {len(p.allowed_token_ids)}")
    _check_bad_words(p, field_prefix)
    if p.HasField("n") and not 1 <= p.n <= MAX_N:
        raise invalid(name("n"), f"must be in [1, {MAX_N}] (samples of the prompt), got {p.n}")
    grammar = grammar_of(p, field_prefix)

    if p.HasField("seed") and not 0 <= p.seed < 2**63:
        raise invalid(name("seed"), f"must be >= 0, got {p.seed}")

    out = common_pb2.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=min_p,
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        repetition_penalty=repetition_penalty,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        no_stop_trim=p.no_stop_trim,
        grammar=grammar,
    )
    # The lists and the map only where given (most requests have none: a few µs each).
    if p.stop:
        out.stop.extend(p.stop)
    if p.stop_token_ids:
        out.stop_token_ids.extend(p.stop_token_ids)
    if p.logit_bias:
        out.logit_bias.update(p.logit_bias)
    if p.allowed_token_ids:
        out.allowed_token_ids.extend(sorted(set(p.allowed_token_ids)))
    if p.bad_words:
        out.bad_words.extend(p.bad_words)
    if p.HasField("seed"):
        out.seed = p.seed
    return out


def _check_bad_words(p: sglang_pb2.SamplingParams, prefix: str) -> None:
    if len(p.bad_words) > MAX_BAD_WORDS:
        raise invalid(f"{prefix}.bad_words", f"at most {MAX_BAD_WORDS} words, got "
                                             f"{len(p.bad_words)}")
    for i, word in enumerate(p.bad_words):
        if not word.strip():
            raise invalid(f"{prefix}.bad_words[{i}]", "must not be empty or blank")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise invalid(f"{prefix}.bad_words[{i}]", f"at most {MAX_BAD_WORD_CHARS} "
                                                      f"characters, got {len(word)}")


def _check_stop(p: sglang_pb2.SamplingParams, prefix: str) -> None:
    if len(p.stop) > MAX_STOP_STRINGS:
        raise invalid(f"{prefix}.stop", f"at most {MAX_STOP_STRINGS} strings, got {len(p.stop)}")
    for i, s in enumerate(p.stop):
        if not s:
            raise invalid(f"{prefix}.stop[{i}]", "must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise invalid(
                f"{prefix}.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
            )
    for i, t in enumerate(p.stop_token_ids):
        if t < 0:
            raise invalid(f"{prefix}.stop_token_ids[{i}]", f"must be >= 0, got {t}")


def _check_logit_bias(p: sglang_pb2.SamplingParams, prefix: str) -> None:
    bias = p.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"{prefix}.logit_bias",
                      f"at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
    for token, value in bias.items():
        if token < 0:
            raise invalid(f"{prefix}.logit_bias", f"token id {token} is negative")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:  # NaN fails too
            raise invalid(f"{prefix}.logit_bias",
                          f"the bias of token {token} must be in [-100, 100], got {_num(value)}")


def check_sampling_ids(sampling: common_pb2.SamplingParams, limits: Limits) -> None:
    """The token ids sampling names (stop_token_ids, logit_bias, allowed_token_ids) are the
    model's."""
    check_token_ids(list(sampling.stop_token_ids), limits, "sampling_params.stop_token_ids")
    check_token_ids(list(sampling.allowed_token_ids), limits, "sampling_params.allowed_token_ids")
    for token in sampling.logit_bias:
        if token >= limits.vocab_size:
            raise invalid("sampling_params.logit_bias", f"token id {token} is out of range "
                          f"[0, {limits.vocab_size}): out of vocabulary")


def check_rid(rid: str, field_path: str = "rid") -> None:
    if not _RID.fullmatch(rid):
        raise invalid(field_path, f"must be 1 to 128 characters of [A-Za-z0-9._:-], got {rid!r}")


def check_token_ids(ids: list[int], limits: Limits, field_path: str) -> None:
    """Every id in [0, vocab_size)."""
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            why = "token ids are non-negative" if t < 0 else "out of vocabulary"
            raise invalid(f"{field_path}[{i}]",
                          f"token id {t} is out of range [0, {limits.vocab_size}): {why}")


def check_prompt_chars(chars: int, limits: Limits, field_path: str = "text") -> None:
    """A text prompt's characters, before it is tokenized: past the bound it cannot fit."""
    limit = limits.max_prompt_chars
    if limit and chars > limit:
        raise invalid(
            field_path,
            f"the prompt is {chars} characters; this gateway takes at most {limit} "
            f"(--max-prompt-chars), more cannot fit the model's context length "
            f"({limits.max_model_len} tokens); shorten the prompt",
        )


def check_batch(requests: int, limit: int, field_path: str) -> None:
    """The requests (prompts x n samples) one call would put into the mesh: more than the
    gateway ever admits at once (`limit`, Limits.max_batch; 0: unchecked) could never be
    admitted."""
    if limit and requests > limit:
        raise invalid(
            field_path,
            f"the call asks for {requests} requests (prompts x n); at most {limit} fit on "
            f"this gateway at once (--max-batch, --max-inflight); split it into smaller calls",
        )


def check_prompt_length(
    prompt_tokens: int, max_new_tokens: int, limits: Limits, *, field_path: str = "input_ids"
) -> None:
    """The prompt must leave room for max_new_tokens within the model's context length.

    For text prompts call this after tokenization with field_path="text".
    """
    if prompt_tokens >= limits.max_model_len:
        raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                        prompt_too_long(field_path, prompt_tokens, limits.max_model_len))
    if prompt_tokens + max_new_tokens > limits.max_model_len:
        raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, completion_too_long(
            prompt_tokens, max_new_tokens, limits.max_model_len))


def _check_unsupported(req: GenerateLike) -> None:
    """Options that later issues implement. SGLang's explicit defaults are accepted."""
    if req.lora_path:
        raise unimplemented("lora_path", "LoRA adapters are not supported yet")
    if req.HasField("disaggregated_params"):
        raise unimplemented(
            "disaggregated_params", "prefill/decode disaggregation is not supported yet"
        )
    if req.HasField("routed_dp_rank") and req.routed_dp_rank < 0:
        raise invalid("routed_dp_rank", f"must be >= 0, got {req.routed_dp_rank}")


def thinking_budget(tokens: int, limits: Limits) -> common_pb2.ThinkingBudget:
    """A budget of `tokens` for the thinking, between the reasoning parser's tags."""
    opening, closing = reasoning_tags(limits, "max_thinking_tokens")
    return common_pb2.ThinkingBudget(tokens=min(tokens, limits.max_model_len), open=opening,
                                     close=closing)


def reasoning_tags(limits: Limits, field_path: str) -> tuple[str, str]:
    """The reasoning parser's tags, for the field that needs them."""
    if limits.thinking_tags is None:
        raise invalid(field_path, "needs a gateway started with --reasoning-parser (it knows "
                                  "where the model's thinking ends)")
    return limits.thinking_tags


def _validated(
    req: GenerateLike, sampling: common_pb2.SamplingParams, limits: Limits, *,
    text: str | None, input_ids: list[int] | None,
) -> ValidatedRequest:
    _check_unsupported(req)
    if req.HasField("max_thinking_tokens"):
        sampling.thinking_budget.CopyFrom(thinking_budget(req.max_thinking_tokens, limits))
    if req.require_reasoning and sampling.grammar:  # SGLang's: the constraint after the thinking
        opening, closing = reasoning_tags(limits, "require_reasoning")
        sampling.grammar = think_first(sampling.grammar, True, (opening, closing))
    check_token_ids(list(req.token_ids_logprob), limits, "token_ids_logprob")
    logprob_options(req, sampling, None if input_ids is None else len(input_ids))
    rid = req.rid if req.HasField("rid") else None
    if rid is not None:
        check_rid(rid)
    params = req.sampling_params
    return ValidatedRequest(
        rid=rid,
        text=text,
        input_ids=input_ids,
        sampling=sampling,
        stream=req.stream,
        return_text=text is not None,
        routing_key=req.routing_key if req.HasField("routing_key") else None,
        trace_headers=dict(req.trace_headers),
        n=params.n if params.HasField("n") else 1,
        dp_rank=req.routed_dp_rank if req.HasField("routed_dp_rank") else None,
        session_id=req.session_id if req.HasField("session_id") else None,
        priority=req.priority,
    )


def validate_text_generate(req: sglang_pb2.TextGenerateRequest, limits: Limits) -> ValidatedRequest:
    """Checks all but the prompt length, which needs the token count (`check_prompt_length`)."""
    text = req.text  # read once: each read of a protobuf string copies it
    if not text:
        raise invalid("text", "must not be empty")
    check_prompt_chars(len(text), limits)
    sampling = normalize_sampling(
        req.sampling_params if req.HasField("sampling_params") else None
    )
    check_sampling_ids(sampling, limits)
    return _validated(req, sampling, limits, text=text, input_ids=None)


def validate_generate(req: sglang_pb2.GenerateRequest, limits: Limits) -> ValidatedRequest:
    if not req.input_ids:
        raise invalid("input_ids", "must not be empty")
    sampling = normalize_sampling(
        req.sampling_params if req.HasField("sampling_params") else None
    )
    check_prompt_length(len(req.input_ids), sampling.max_new_tokens, limits)  # before each id
    ids = list(req.input_ids)
    check_token_ids(ids, limits, "input_ids")
    check_sampling_ids(sampling, limits)
    return _validated(req, sampling, limits, text=None, input_ids=ids)


def validate_chat(req: sglang_pb2.GenerateRequest, chat: tokenizer_pb2.ChatTemplateRequest,
                  fill_max_new_tokens: bool, limits: Limits) -> ValidatedRequest:
    """A chat's request (`req` without its prompt: the tokenizer renders it from `chat`'s
    messages, and checks its length as TextGenerate's, under the name input_ids)."""
    sampling = normalize_sampling(
        req.sampling_params if req.HasField("sampling_params") else None
    )
    check_sampling_ids(sampling, limits)
    v = _validated(req, sampling, limits, text=None, input_ids=None)
    v.chat, v.fill_max_new_tokens = chat, fill_max_new_tokens
    return v


_EmbedLike = sglang_pb2.TextEmbedRequest | sglang_pb2.EmbedRequest | sglang_pb2.ClassifyRequest


def _validated_embed(
    req: _EmbedLike, *, text: str | None, input_ids: list[int] | None
) -> ValidatedRequest:
    rid = req.rid if req.HasField("rid") else None
    if rid is not None:
        check_rid(rid)
    return ValidatedRequest(
        rid=rid,
        text=text,
        input_ids=input_ids,
        sampling=common_pb2.SamplingParams(max_new_tokens=0, logprob_start_len=-1),
        stream=False,
        return_text=False,
        routing_key=req.routing_key if req.HasField("routing_key") else None,
        trace_headers=dict(req.trace_headers),
        embed=True,
    )


def validate_text_embed(req: sglang_pb2.TextEmbedRequest,
                        limits: Limits | None = None) -> ValidatedRequest:
    """The prompt's length in tokens is checked after tokenization, as for TextGenerate."""
    text = req.text
    if not text:
        raise invalid("text", "must not be empty")
    if limits is not None:
        check_prompt_chars(len(text), limits)
    return _validated_embed(req, text=text, input_ids=None)


def validate_embed(req: sglang_pb2.EmbedRequest, limits: Limits) -> ValidatedRequest:
    if not req.input_ids:
        raise invalid("input_ids", "must not be empty")
    check_prompt_length(len(req.input_ids), 0, limits)  # before each id is looked at
    ids = list(req.input_ids)
    check_token_ids(ids, limits, "input_ids")
    return _validated_embed(req, text=None, input_ids=ids)


def validate_classify(req: sglang_pb2.ClassifyRequest, limits: Limits) -> ValidatedRequest:
    """Classify: text or input_ids (exactly one), run as an embedding request (a
    classifier's pooled output is its class logits)."""
    ids = list(req.input_ids)
    text = req.text
    if text and ids:
        raise invalid("input_ids", "give text or input_ids, not both")
    if text:
        check_prompt_chars(len(text), limits)
        return _validated_embed(req, text=text, input_ids=None)
    if not ids:
        raise invalid("text", "give text or input_ids")
    check_prompt_length(len(ids), 0, limits)
    check_token_ids(ids, limits, "input_ids")
    return _validated_embed(req, text=None, input_ids=ids)


def validate_tokenize(req: sglang_pb2.TokenizeRequest, limits: Limits | None = None) -> None:
    """Any text within the prompt bound; the empty text too (no tokens, or the special ones)."""
    if limits is not None:
        check_prompt_chars(len(req.text), limits)


def validate_detokenize(req: sglang_pb2.DetokenizeRequest, limits: Limits) -> None:
    check_token_ids(list(req.tokens), limits, "tokens")
