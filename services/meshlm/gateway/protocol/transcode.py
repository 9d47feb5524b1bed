"""HTTP/JSON transcoding of SglangService, driven by its google.api.http annotations.

`routes()` reads every method's HttpRule into an `HttpBinding`; `bind_request` builds the
request message from path variables, query parameters and the JSON body as google.api.http
specifies (body "*": the whole body is the request and there are no query parameters; body
"<field>": the body is that field; the rest from the path and the query string, whose keys are
field paths and may repeat for repeated fields). The encoders below give the wire shapes: the
message JSON for unary replies, {"result": ...} / {"error": Status} lines for server streams,
and the google.rpc.Status JSON for errors. Pure: no HTTP framework here. SGLang's own
/generate and /encode bodies are `native.py`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import orjson
from google.api import annotations_pb2, http_pb2
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from meshlm.common.errors import MeshError, invalid
from sglang.runtime.v1 import sglang_pb2

_M = TypeVar("_M", bound=Message)
_VARIABLE = re.compile(r"\{([A-Za-z_][\w.]*)(?:=([^}]*))?\}")


@dataclass(frozen=True)
class PathTemplate:
    """A google.api.http path template, e.g. "/v1/{name=models/*}:get", compiled to a regex."""

    template: str
    regex: re.Pattern[str]
    fields: tuple[str, ...]  # field path bound by each capture group v0, v1, ...

    @classmethod
    def parse(cls, template: str) -> PathTemplate:
        pattern, pos = "", 0
        fields: list[str] = []
        for m in _VARIABLE.finditer(template):
            pattern += _segments(template[pos : m.start()])
            pattern += f"(?P<v{len(fields)}>{_segments(m.group(2) or '*')})"
            fields.append(m.group(1))
            pos = m.end()
        pattern += _segments(template[pos:])
        return cls(template, re.compile(pattern + r"\Z"), tuple(fields))

    def match(self, path: str) -> dict[str, str] | None:
        """Field path -> value of each variable, or None when the path does not match."""
        m = self.regex.match(path)
        if m is None:
            return None
        return {f: m.group(f"v{i}") for i, f in enumerate(self.fields)}


def _segments(text: str) -> str:
    parts = []
    for seg in text.split("/"):
        if seg == "**":
            parts.append(".*")
        elif seg == "*":
            parts.append("[^/]+?")
        else:
            parts.append(re.escape(seg))
    return "/".join(parts)


@dataclass(frozen=True)
class HttpBinding:
    """One HTTP route of one RPC."""

    rpc: str
    http_method: str  # GET, POST, ...
    path: PathTemplate
    body: str  # "" (no body), "*" (whole request) or a top-level field name
    request_cls: type[Message]
    response_cls: type[Message]
    server_streaming: bool


def routes(service: ServiceDescriptor | None = None) -> list[HttpBinding]:
    """Every HttpRule (additional_bindings included) of the service's methods."""
    service = service or sglang_pb2.DESCRIPTOR.services_by_name["SglangService"]
    out: list[HttpBinding] = []
    for method in service.methods:
        options = method.GetOptions()
        if not options.HasExtension(annotations_pb2.http):
            continue
        rule = options.Extensions[annotations_pb2.http]
        for r in [rule, *rule.additional_bindings]:
            verb, path = _verb_and_path(r)
            out.append(
                HttpBinding(
                    rpc=method.name,
                    http_method=verb,
                    path=PathTemplate.parse(path),
                    body=r.body,
                    request_cls=GetMessageClass(method.input_type),
                    response_cls=GetMessageClass(method.output_type),
                    server_streaming=method.server_streaming,
                )
            )
    return out


def _verb_and_path(rule: http_pb2.HttpRule) -> tuple[str, str]:
    kind = rule.WhichOneof("pattern")
    if kind == "custom":
        return rule.custom.kind.upper(), rule.custom.path
    if kind is None:
        raise ValueError("HttpRule without a pattern")
    return kind.upper(), getattr(rule, kind)


# ---- request binding -------------------------------------------------------------------------


def parse_json_body(body: bytes) -> Any:
    """orjson.loads with the client-facing error; an empty body is {}."""
    if not body.strip():
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise MeshError(
            grpc.StatusCode.INVALID_ARGUMENT, f"request body is not valid JSON: {e}"
        ) from None


def bind_request(
    binding: HttpBinding,
    path_params: dict[str, str],
    query: Iterable[tuple[str, str]],
    body: bytes,
) -> Message:
    """The request message for one HTTP call, or MeshError(INVALID_ARGUMENT) saying what to fix."""
    descriptor = binding.request_cls.DESCRIPTOR
    doc: dict[str, Any] = {}
    if binding.body:
        payload = parse_json_body(body)
        if binding.body == "*":
            if not isinstance(payload, dict):
                raise invalid("body", "must be a JSON object")
            doc = payload
        else:
            doc = {binding.body: payload}
        check_known_fields(doc, descriptor, "")
    query = list(query)
    if binding.body == "*" and query:
        key = query[0][0]
        raise invalid(
            key,
            f"{binding.http_method} {binding.path.template} takes the whole request in the "
            "JSON body; move the field there instead of the query string",
        )
    scalars: dict[str, Any] = {}
    for key, raw in query:
        _set_path(scalars, descriptor, key, raw)
    for key, raw in path_params.items():
        _set_path(scalars, descriptor, key, raw)
    _merge(doc, scalars)
    return parse_dict(doc, binding.request_cls())


# Long top-level strings and integer lists are set directly: json_format scans every string for
# unpaired surrogates and converts list items one by one, in Python, on the event loop (about
# 280 ms for a 10 MB prompt, 2 s per million token ids). orjson never returns a lone surrogate;
# protobuf checks the integers' types and ranges itself.
DIRECT_CHARS = 4096
DIRECT_ITEMS = 4096
_INTEGERS = frozenset({FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64,
                       FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
                       FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64})


def parse_dict(doc: dict[str, Any], message: _M) -> _M:
    """json_format.ParseDict, a wrong type becoming INVALID_ARGUMENT with json_format's words;
    long top-level strings and integer lists are set directly (DIRECT_CHARS, DIRECT_ITEMS)."""
    direct = {key: f for key, f in ((k, _direct_field(message, k, v)) for k, v in doc.items())
              if f is not None}
    rest = {k: v for k, v in doc.items() if k not in direct} if direct else doc
    try:
        json_format.ParseDict(rest, message, ignore_unknown_fields=False)
    except json_format.ParseError as e:
        nested = _nested_ints(message.DESCRIPTOR, rest)
        if nested is not None:
            raise invalid(nested, "must be a flat list of integers") from None
        raise invalid("request body", str(e)) from None
    for key, f in direct.items():
        try:
            if _is_repeated(f):
                getattr(message, f.name).extend(doc[key])
            else:
                setattr(message, f.name, doc[key])
        except UnicodeEncodeError:
            raise invalid(key, "is not valid Unicode text (an unpaired surrogate)") from None
        except (TypeError, ValueError) as e:
            raise invalid(key, f"must be a list of integers: {e}") from None
    return message


def _nested_ints(descriptor: Descriptor, doc: dict[str, Any]) -> str | None:
    """The top-level key of a repeated integer field (token ids) given a list of lists, which
    json_format refuses in its own words; None when there is none."""
    for key, value in doc.items():
        f = _by_name(descriptor, key)
        if (f is not None and f.type in _INTEGERS and _is_repeated(f)
                and isinstance(value, list) and any(isinstance(x, list) for x in value)):
            return key
    return None


def _direct_field(message: Message, key: str, value: Any) -> FieldDescriptor | None:
    """The field `key` names if its value is set directly: a long string or integer list."""
    if isinstance(value, str) and len(value) >= DIRECT_CHARS:
        f = _by_name(message.DESCRIPTOR, key)
        if f is not None and f.type == FieldDescriptor.TYPE_STRING and not _is_repeated(f):
            return f
    elif isinstance(value, list) and len(value) >= DIRECT_ITEMS:
        f = _by_name(message.DESCRIPTOR, key)
        if f is not None and f.type in _INTEGERS and _is_repeated(f):
            return f
    return None


def check_known_fields(doc: Any, descriptor: Descriptor, prefix: str) -> None:
    """Reject unknown keys, naming the field path and the known names in proto spelling
    (json_format's own message lists camelCase names and only the message type)."""
    if not isinstance(doc, dict):
        return  # a wrong type: json_format says so
    for key, value in doc.items():
        f = descriptor.fields_by_name.get(key) or _by_json_name(descriptor, key)
        path = f"{prefix}{key}"
        if f is None:
            known = ", ".join(x.name for x in descriptor.fields)
            raise invalid(path, f"unknown field; {descriptor.name} has: {known}")
        sub = f.message_type
        if sub is None or sub.full_name.startswith("google.protobuf."):
            continue  # scalars and well-known types (their own JSON forms)
        if _is_map(f):
            value_type = sub.fields_by_name["value"].message_type
            if value_type is not None and isinstance(value, dict):
                for k, v in value.items():
                    check_known_fields(v, value_type, f"{path}[{k}].")
            continue
        items = value if isinstance(value, list) and _is_repeated(f) else [value]
        for item in items:
            check_known_fields(item, sub, f"{path}.")


def _by_json_name(descriptor: Descriptor, key: str) -> FieldDescriptor | None:
    return next((f for f in descriptor.fields if f.json_name == key), None)


def _by_name(descriptor: Descriptor, key: str) -> FieldDescriptor | None:
    """The field a JSON key names (json_format takes the JSON name or the proto name)."""
    return _by_json_name(descriptor, key) or descriptor.fields_by_name.get(key)


def _is_repeated(f: FieldDescriptor) -> bool:
    if hasattr(f, "is_repeated"):  # protobuf >= 5.29; `label` is gone in 7
        return bool(f.is_repeated)
    return bool(f.label == FieldDescriptor.LABEL_REPEATED)


def _is_map(f: FieldDescriptor) -> bool:
    return (
        _is_repeated(f) and f.message_type is not None and f.message_type.GetOptions().map_entry
    )


def _set_path(doc: dict[str, Any], descriptor: Descriptor, key: str, raw: str) -> None:
    """Set field path `key` ("a.b.c") of `doc` from a path or query string value."""
    names = key.split(".")
    for i, name in enumerate(names):
        f = descriptor.fields_by_name.get(name) or _by_json_name(descriptor, name)
        prefix = ".".join(names[: i + 1])
        if f is None:
            known = ", ".join(x.name for x in descriptor.fields)
            raise invalid(prefix, f"unknown field; {descriptor.name} has: {known}")
        last = i == len(names) - 1
        if _is_map(f) or (f.message_type is not None and (last or _is_repeated(f))):
            raise invalid(prefix, "cannot be set from the URL; send it in a JSON body")
        if not last:
            if f.message_type is None:
                raise invalid(prefix, "is not a message; it has no sub-fields")
            doc = doc.setdefault(f.name, {})
            descriptor = f.message_type
            continue
        value = _scalar(f, raw, key)
        if _is_repeated(f):
            doc.setdefault(f.name, []).append(value)
        elif f.name in doc:
            raise invalid(key, "given more than once")
        else:
            doc[f.name] = value


def _scalar(f: FieldDescriptor, raw: str, key: str) -> Any:
    if f.type == FieldDescriptor.TYPE_BOOL:
        if raw.lower() in ("true", "1"):
            return True
        if raw.lower() in ("false", "0"):
            return False
        raise invalid(key, f"must be true or false, got {raw!r}")
    return raw  # json_format parses numbers, enums and base64 bytes from strings


def _merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


# ---- response encoding -----------------------------------------------------------------------


def message_dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def message_json(message: Message) -> bytes:
    return orjson.dumps(message_dict(message))


def status_dict(err: MeshError) -> dict[str, Any]:
    """google.rpc.Status as JSON."""
    return {"code": err.code_number, "message": err.message, "details": []}


def status_json(err: MeshError) -> bytes:
    return orjson.dumps(status_dict(err))


def result_line(message: Message) -> bytes:
    """One NDJSON line of a server stream."""
    return orjson.dumps({"result": message_dict(message)}) + b"\n"


def error_line(err: MeshError) -> bytes:
    """The last NDJSON line of a server stream that failed after its first message."""
    return orjson.dumps({"error": status_dict(err)}) + b"\n"
