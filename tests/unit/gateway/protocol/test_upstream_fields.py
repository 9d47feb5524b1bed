"""meshlm's public proto against upstream's: SGLang's proto/sglang/runtime/v1/sglang.proto on
its main branch, field by field, written down here (not fetched). Every upstream field must be in
meshlm's descriptors with the same name, number, type and label (deprecation included); every
field meshlm adds must take a number upstream leaves free (100 and up) and be listed in
MESHLM_OWN. When upstream changes, change UPSTREAM (and the proto) together."""

from __future__ import annotations

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor
from sglang_upstream import UPSTREAM, UPSTREAM_RPCS, lines

from sglang.runtime.v1 import sglang_pb2

# meshlm's own fields, on numbers upstream does not use (the proto's header lists them too).
MESHLM_OWN = {
    "SamplingParams": """
        optional bool skip_special_tokens = 100
        optional bool no_stop_trim = 102
        map<int32,float> logit_bias = 103
        repeated int32 allowed_token_ids = 104
        repeated string bad_words = 105""",
    "TextGenerateRequest": "repeated int32 token_ids_logprob = 101",
    "TextGenerateResponse": "repeated int32 output_ids = 100",
    "GenerateRequest": """
        optional bool return_text_in_logprobs = 100
        repeated int32 token_ids_logprob = 101""",
}

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {_F.TYPE_FLOAT: "float", _F.TYPE_DOUBLE: "double", _F.TYPE_INT32: "int32",
          _F.TYPE_INT64: "int64", _F.TYPE_UINT32: "uint32", _F.TYPE_UINT64: "uint64",
          _F.TYPE_BOOL: "bool", _F.TYPE_STRING: "string", _F.TYPE_BYTES: "bytes"}


def rendered(desc: Descriptor) -> dict[str, str]:
    """meshlm's descriptor of a message, as table lines by field number."""
    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    maps = {n.name: n for n in proto.nested_type if n.options.map_entry}
    out = {}
    for f in proto.field:
        short = f.type_name.rsplit(".", 1)[-1]
        if short in maps:
            key, value = (_TYPES[x.type] for x in maps[short].field)
            kind = f"map<{key},{value}>"
        else:
            kind = _TYPES.get(f.type, short)
        if f.proto3_optional:
            label = "optional "
        elif f.HasField("oneof_index"):
            label = f"oneof {proto.oneof_decl[f.oneof_index].name} "
        elif f.label == _F.LABEL_REPEATED and short not in maps:
            label = "repeated "
        else:
            label = ""
        deprecated = " deprecated" if f.options.deprecated else ""
        out[str(f.number)] = f"{label}{kind} {f.name} = {f.number}{deprecated}"
    return out


def test_every_upstream_field_is_meshlms_with_the_same_number_name_type_and_label() -> None:
    drift = []
    for name, spec in UPSTREAM.items():
        ours = rendered(sglang_pb2.DESCRIPTOR.message_types_by_name[name])
        for number, line in lines(spec).items():
            if ours.get(number) != line:
                drift.append(f"{name}: upstream has {line!r}, meshlm {ours.get(number)!r}")
    assert not drift, "\n".join(drift)


def test_meshlms_own_fields_are_listed_and_numbered_where_upstream_has_none() -> None:
    assert set(sglang_pb2.DESCRIPTOR.message_types_by_name) == set(UPSTREAM)
    own = {}
    for name, desc in sglang_pb2.DESCRIPTOR.message_types_by_name.items():
        upstream = lines(UPSTREAM[name])
        own.update({(name, n): line for n, line in rendered(desc).items() if n not in upstream})
    listed = {(name, n): line for name, spec in MESHLM_OWN.items()
              for n, line in lines(spec).items()}
    assert own == listed
    assert all(int(number) >= 100 for _, number in own)


def test_the_service_has_upstreams_methods_and_types() -> None:
    ours = []
    for m in sglang_pb2.DESCRIPTOR.services_by_name["SglangService"].methods:
        proto = descriptor_pb2.MethodDescriptorProto()
        m.CopyToProto(proto)
        stream = "stream " if proto.server_streaming else ""
        assert not proto.client_streaming
        ours.append(f"{m.name} {m.input_type.name} {stream}{m.output_type.name}")
    assert ours == [" ".join(line.split()) for line in UPSTREAM_RPCS.strip().splitlines()]


def test_the_wire_bytes_of_moved_fields() -> None:
    """What an upstream client sends for the fields that moved since the RFC, byte by byte:
    the tag is (number << 3 | wire type)."""
    assert sglang_pb2.SamplingParams(seed=5).SerializeToString() == bytes([16 << 3, 1, 5])
    assert sglang_pb2.TextGenerateRequest(session_id="s").SerializeToString() == (
        bytes([13 << 3 | 2, 1]) + b"s")
    assert sglang_pb2.GenerateRequest(priority=3).SerializeToString() == bytes([14 << 3, 3])
    empty = sglang_pb2.GuidedDecoding()  # 17 << 3 | 2 = 138: a two-byte varint tag
    assert sglang_pb2.SamplingParams(guided_decoding=empty).SerializeToString() == bytes(
        [138, 1, 0])
