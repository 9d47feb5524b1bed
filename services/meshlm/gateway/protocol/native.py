"""SGLang's native /generate and /encode bodies -> the public request messages, one per prompt
(a batch is a list of texts or of id lists). Pure: no HTTP framework here."""

from __future__ import annotations

import json
from typing import Any

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.json_body import is_int
from meshlm.gateway.protocol.transcode import check_known_fields, parse_dict, parse_json_body
from meshlm.gateway.protocol.validation import check_batch, unimplemented
from sglang.runtime.v1 import sglang_pb2

NativeRequest = sglang_pb2.TextGenerateRequest | sglang_pb2.GenerateRequest


# Fields of a batched /generate body that may give one value per prompt (a list) instead of
# one value for all (io_struct's normalisation).
_PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "return_text_in_logprobs", "routing_key", "routed_dp_rank",
               "session_id", "priority")
# SGLang's sampling params for constrained decoding that the proto has only inside
# guided_decoding (json_schema and regex have fields of their own).
_GUIDED = ("ebnf", "structural_tag")
# Token ids whose logprobs are asked for: one flat list for a prompt; in a batch, one flat list
# for every prompt or a list of them, one per prompt (io_struct's normalisation).
_ASKED = "token_ids_logprob"
_INT32 = 2**31
# SGLang's request fields that meshlm does not serve, taken at their defaults (a client may
# send its whole request object); another value is UNIMPLEMENTED, naming the field.
_AT_DEFAULT = {"return_hidden_states": "hidden states are not returned",
               "return_routed_experts": "routed experts are not returned",
               "custom_logit_processor": "custom logit processors are not supported"}
_SAMPLING_AT_DEFAULT = {"stop_regex": "regex stops are not supported; use stop strings",
                        "custom_params": "custom logit processors are not supported"}


def native_generate_requests(body: bytes, max_batch: int = 0
                             ) -> tuple[list[NativeRequest], bool]:
    """SGLang's /generate body -> one TextGenerateRequest ("text") or GenerateRequest
    ("input_ids") per prompt, and whether the body was a batch (a list of texts or of id
    lists). In a batch, the fields of `_PER_PROMPT` are either one value for every prompt or
    a list with one value per prompt.

    Sampling params use SGLang's names, which are the proto's; "stop" may be a single string.
    JSON nulls mean "not given"; SGLang's "ebnf" and "structural_tag" go into the proto's
    guided_decoding. "token_ids_logprob" is a flat list of token ids (in a batch
    also a list of them, one per prompt). A batch of more than `max_batch` prompts (0: no limit)
    is refused before it is split.
    """
    doc, has_text = _native_prompt(body, batch_ok=True)
    key = "text" if has_text else "input_ids"
    prompts = doc[key]
    is_batch = isinstance(prompts, list) and (has_text or _is_batch(prompts))
    if not is_batch:
        if _ASKED in doc:
            _check_asked(doc[_ASKED], _ASKED, batch=False)
        return [_native_generate(doc, has_text)], False
    docs = _split_batch(doc, key, _PER_PROMPT, max_batch)
    if _ASKED in doc:
        _split_asked(doc[_ASKED], docs)
    return [_native_generate(d, has_text) for d in docs], True


def native_generate_request(body: bytes) -> NativeRequest:
    """A /generate body of one prompt (see `native_generate_requests`)."""
    requests, batch = native_generate_requests(body)
    if batch:
        raise invalid("text", "give one prompt here, not a list of them")
    return requests[0]


def _native_generate(doc: dict[str, Any], has_text: bool) -> NativeRequest:
    _take_defaults(doc, _AT_DEFAULT, "")
    doc.pop("log_metrics", None)  # SGLang's metrics switch: meshlm's metrics are always kept
    sampling = doc.get("sampling_params")
    if isinstance(sampling, dict):
        sampling = {k: v for k, v in sampling.items() if v is not None}
        _take_defaults(sampling, _SAMPLING_AT_DEFAULT, "sampling_params.")
        if "sampling_seed" in sampling:  # SGLang's newer name for the seed
            if "seed" in sampling:
                raise invalid("sampling_params.sampling_seed", "give seed or sampling_seed, "
                                                               "not both")
            sampling["seed"] = sampling.pop("sampling_seed")
        # Slow (Python) tokenizers' alone, as on the OpenAI routes: fast ones never put spaces
        # between special tokens.
        if not isinstance(sampling.pop("spaces_between_special_tokens", True), bool):
            raise invalid("sampling_params.spaces_between_special_tokens",
                          "must be true or false")
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        for name in _GUIDED:
            if name in sampling:
                value = sampling.pop(name)
                if name == "structural_tag" and isinstance(value, dict):  # SGLang: its text
                    value = json.dumps(value)
                sampling.setdefault("guided_decoding", {})[name] = value
        if isinstance(sampling.get("json_schema"), dict):  # SGLang takes its text; either here
            sampling["json_schema"] = json.dumps(sampling["json_schema"])
        doc["sampling_params"] = sampling
    cls = sglang_pb2.TextGenerateRequest if has_text else sglang_pb2.GenerateRequest
    check_known_fields(doc, cls.DESCRIPTOR, "")
    return parse_dict(doc, cls())


def _take_defaults(doc: dict[str, Any], fields: dict[str, str], prefix: str) -> None:
    """Drop `fields` that hold their default (false, or an empty value); UNIMPLEMENTED, with
    its problem, for any other value."""
    for name, problem in fields.items():
        if name in doc and doc.pop(name) not in (False, "", [], {}):
            raise unimplemented(f"{prefix}{name}", problem)


def _split_asked(value: Any, docs: list[dict[str, Any]]) -> None:
    """A batch's token_ids_logprob into its prompts' bodies: one flat list for all, or one
    list (or null) per prompt."""
    if not (isinstance(value, list) and any(x is None or isinstance(x, list) for x in value)):
        _check_asked(value, _ASKED, batch=True)
        return
    if len(value) != len(docs):
        raise invalid(_ASKED, f"has {len(value)} lists for {len(docs)} prompts; give one flat "
                              "list for all, or one per prompt")
    for i, (ids, one) in enumerate(zip(value, docs, strict=True)):
        if ids is None:
            del one[_ASKED]
        else:
            _check_asked(ids, f"{_ASKED}[{i}]", batch=False)
            one[_ASKED] = ids


def _check_asked(value: Any, field: str, *, batch: bool) -> None:
    """A flat list of token ids (ids past int32 cannot be in any vocabulary)."""
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        where = ("one for every prompt, or a list of them, one per prompt" if batch
                 else "a list of lists is for a batch of prompts")
        raise invalid(field, f"must be a flat list of integers (token ids); {where}")
    for i, t in enumerate(value):
        if not -_INT32 <= t < _INT32:
            why = "token ids are non-negative" if t < 0 else "out of vocabulary"
            raise invalid(f"{field}[{i}]", f"token id {t} is out of range: {why}")


NativeEmbedRequest = sglang_pb2.TextEmbedRequest | sglang_pb2.EmbedRequest


def native_embed_requests(body: bytes, max_batch: int = 0
                          ) -> tuple[list[NativeEmbedRequest], bool]:
    """SGLang's /encode body -> one TextEmbedRequest ("text") or EmbedRequest ("input_ids") per
    prompt, and whether it was a batch; "rid" may be a list, one per prompt. At most
    `max_batch` prompts (0: no limit)."""
    doc, has_text = _native_prompt(body, batch_ok=True)
    key = "text" if has_text else "input_ids"
    cls = sglang_pb2.TextEmbedRequest if has_text else sglang_pb2.EmbedRequest
    prompts = doc[key]
    if not (isinstance(prompts, list) and (has_text or _is_batch(prompts))):
        check_known_fields(doc, cls.DESCRIPTOR, "")
        return [parse_dict(doc, cls())], False
    docs = _split_batch(doc, key, ("rid", "routing_key"), max_batch)
    for one in docs:
        check_known_fields(one, cls.DESCRIPTOR, "")
    return [parse_dict(one, cls()) for one in docs], True


def _split_batch(doc: dict[str, Any], key: str, per_prompt: tuple[str, ...],
                 max_batch: int = 0) -> list[dict[str, Any]]:
    """A batched body -> one body per prompt of `doc[key]`; each field of `per_prompt` that
    is a list gives one value per prompt."""
    prompts = doc[key]
    if not prompts:
        raise invalid(key, "the batch is empty; give at least one prompt")
    check_batch(len(prompts), max_batch, key)
    docs = []
    for i, prompt in enumerate(prompts):
        one = {**doc, key: prompt}
        for name in per_prompt:
            value = doc.get(name)
            if isinstance(value, list):
                if len(value) != len(prompts):
                    raise invalid(name, f"has {len(value)} entries for {len(prompts)} prompts; "
                                        "give one value, or one per prompt")
                one[name] = value[i]
        docs.append(one)
    return docs


def _native_prompt(body: bytes, batch_ok: bool = False) -> tuple[dict[str, Any], bool]:
    """A native body without its nulls, and whether its prompt is "text" (else "input_ids");
    batches (lists of prompts) only where `batch_ok`."""
    doc = parse_json_body(body)
    if not isinstance(doc, dict):
        raise invalid("body", "must be a JSON object")
    doc = {k: v for k, v in doc.items() if v is not None}
    has_text, has_ids = "text" in doc, "input_ids" in doc
    if has_text == has_ids:
        got = "both were given" if has_text else "neither was given"
        raise invalid("text", f"give exactly one of text and input_ids; {got}")
    batch = has_text and isinstance(doc["text"], list) or has_ids and _is_batch(doc["input_ids"])
    if batch and not batch_ok:
        field = "text" if has_text else "input_ids"
        raise invalid(field, "give one prompt here, not a list of them")
    return doc, has_text


def _is_batch(input_ids: Any) -> bool:
    """A list of id lists (by its first entry: a mixed list fails as either kind), not a
    scan of what may be millions of ids."""
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
