"""meshlm's public proto against upstream's: SGLang's proto/sglang/runtime/v1/sglang.proto on
its main branch, field by field, written down here (not fetched). Every upstream field must be in
meshlm's descriptors with the same name, number, type and label (deprecation included); every
field meshlm adds must take a number upstream leaves free (100 and up) and be listed in
MESHLM_OWN. When upstream changes, change UPSTREAM (and the proto) together."""

from __future__ import annotations

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor

from sglang.runtime.v1 import sglang_pb2

# One line per field: "[optional | repeated | oneof <name>] <type> <name> = <number>
# [deprecated]"; maps as "map<key,value>".
UPSTREAM: dict[str, str] = {
    "DisaggregatedParams": """
        string bootstrap_host = 1
        int32 bootstrap_port = 2
        int64 bootstrap_room = 3""",
    "SamplingParams": """
        optional float temperature = 1
        optional float top_p = 2
        optional int32 top_k = 3
        optional float min_p = 4
        optional float frequency_penalty = 5
        optional float presence_penalty = 6
        optional float repetition_penalty = 7
        optional int32 max_new_tokens = 8
        optional int32 min_new_tokens = 9
        repeated string stop = 10
        repeated int32 stop_token_ids = 11
        optional bool ignore_eos = 12
        optional int32 n = 13
        optional string json_schema = 14 deprecated
        optional string regex = 15 deprecated
        optional int64 seed = 16
        optional GuidedDecoding guided_decoding = 17""",
    "GuidedDecoding": """
        oneof constraint string json_schema = 1
        oneof constraint string regex = 2
        oneof constraint string ebnf = 3
        oneof constraint ChoiceConstraint choice = 4
        oneof constraint string structural_tag = 5""",
    "ChoiceConstraint": "repeated string values = 1",
    "TextGenerateRequest": """
        string text = 1
        optional SamplingParams sampling_params = 2
        optional bool stream = 3
        optional bool return_logprob = 4
        optional int32 top_logprobs_num = 5
        optional int32 logprob_start_len = 6
        optional bool return_text_in_logprobs = 7
        optional string rid = 8
        optional string lora_path = 9
        optional string routing_key = 10
        optional int32 routed_dp_rank = 11
        map<string,string> trace_headers = 12
        optional string session_id = 13
        optional DisaggregatedParams disaggregated_params = 14
        optional int32 priority = 15
        optional bool require_reasoning = 16
        optional uint32 max_thinking_tokens = 17""",
    "TextGenerateResponse": """
        string text = 1
        map<string,string> meta_info = 2
        bool finished = 3""",
    "GenerateRequest": """
        repeated int32 input_ids = 1
        optional SamplingParams sampling_params = 2
        optional bool stream = 3
        optional bool return_logprob = 4
        optional int32 top_logprobs_num = 5
        optional int32 logprob_start_len = 6
        optional string rid = 7
        optional string lora_path = 8
        optional string routing_key = 9
        optional int32 routed_dp_rank = 10
        map<string,string> trace_headers = 11
        optional string session_id = 12
        optional DisaggregatedParams disaggregated_params = 13
        optional int32 priority = 14
        optional bool require_reasoning = 15
        optional uint32 max_thinking_tokens = 16""",
    "GenerateResponse": """
        repeated int32 output_ids = 1
        map<string,string> meta_info = 2
        bool finished = 3""",
    "TextEmbedRequest": """
        string text = 1
        optional string rid = 2
        optional string routing_key = 3
        map<string,string> trace_headers = 4""",
    "TextEmbedResponse": "repeated float embedding = 1\nmap<string,string> meta_info = 2",
    "EmbedRequest": """
        repeated int32 input_ids = 1
        optional string rid = 2
        optional string routing_key = 3
        map<string,string> trace_headers = 4""",
    "EmbedResponse": "repeated float embedding = 1\nmap<string,string> meta_info = 2",
    "ClassifyRequest": """
        string text = 1
        repeated int32 input_ids = 2
        optional string rid = 3
        optional string routing_key = 4
        map<string,string> trace_headers = 5""",
    "ClassifyResponse": "repeated float embedding = 1\nmap<string,string> meta_info = 2",
    "TokenizeRequest": "string text = 1\noptional bool add_special_tokens = 2",
    "TokenizeResponse": """
        repeated int32 tokens = 1
        int32 count = 2
        int32 max_model_len = 3
        string input_text = 4""",
    "DetokenizeRequest": "repeated int32 tokens = 1",
    "DetokenizeResponse": "string text = 1",
    "HealthCheckRequest": "",
    "HealthCheckResponse": "bool healthy = 1",
    "GetModelInfoRequest": "",
    "GetModelInfoResponse": "string model_path = 1\nstring json_info = 2",
    "GetServerInfoRequest": "",
    "GetServerInfoResponse": "string json_info = 1",
    "ListModelsRequest": "",
    "ListModelsResponse": "repeated ModelCard models = 1",
    "ModelCard": """
        string id = 1
        string root = 2
        optional string parent = 3
        optional int32 max_model_len = 4""",
    "GetLoadRequest": "optional int32 dp_rank = 1",
    "GetLoadResponse": "string json_info = 1",
    "AbortRequest": "string rid = 1\nbool abort_all = 2",
    "AbortResponse": "bool success = 1",
    "FlushCacheRequest": "",
    "FlushCacheResponse": "bool success = 1\nstring message = 2",
    "PauseGenerationRequest": "string mode = 1",
    "PauseGenerationResponse": "string message = 1",
    "ContinueGenerationRequest": "",
    "ContinueGenerationResponse": "string message = 1",
    "OpenAIRequest": "bytes json_body = 1\nmap<string,string> trace_headers = 2",
    "OpenAIStreamChunk": "bytes json_chunk = 1\nbool finished = 2",
    "OpenAIResponse": "bytes json_body = 1\nint32 status_code = 2",
    "StartProfileRequest": "optional string output_dir = 1",
    "StartProfileResponse": "string message = 1",
    "StopProfileRequest": "",
    "StopProfileResponse": "string message = 1",
    "UpdateWeightsRequest": "string model_path = 1\noptional string load_format = 2",
    "UpdateWeightsResponse": "bool success = 1\nstring message = 2",
}

# SglangService: "Method Request Response", "stream" before a streamed response.
UPSTREAM_RPCS = """
    TextGenerate TextGenerateRequest stream TextGenerateResponse
    Generate GenerateRequest stream GenerateResponse
    TextEmbed TextEmbedRequest TextEmbedResponse
    Embed EmbedRequest EmbedResponse
    Classify ClassifyRequest ClassifyResponse
    Tokenize TokenizeRequest TokenizeResponse
    Detokenize DetokenizeRequest DetokenizeResponse
    HealthCheck HealthCheckRequest HealthCheckResponse
    GetModelInfo GetModelInfoRequest GetModelInfoResponse
    GetServerInfo GetServerInfoRequest GetServerInfoResponse
    ListModels ListModelsRequest ListModelsResponse
    GetLoad GetLoadRequest GetLoadResponse
    Abort AbortRequest AbortResponse
    FlushCache FlushCacheRequest FlushCacheResponse
    PauseGeneration PauseGenerationRequest PauseGenerationResponse
    ContinueGeneration ContinueGenerationRequest ContinueGenerationResponse
    ChatComplete OpenAIRequest stream OpenAIStreamChunk
    Complete OpenAIRequest stream OpenAIStreamChunk
    OpenAIEmbed OpenAIRequest OpenAIResponse
    OpenAIClassify OpenAIRequest OpenAIResponse
    Score OpenAIRequest OpenAIResponse
    Rerank OpenAIRequest OpenAIResponse
    StartProfile StartProfileRequest StartProfileResponse
    StopProfile StopProfileRequest StopProfileResponse
    UpdateWeightsFromDisk UpdateWeightsRequest UpdateWeightsResponse"""

# meshlm's own fields, on numbers upstream does not use (the proto's header lists them too).
MESHLM_OWN = {
    "SamplingParams": "optional bool skip_special_tokens = 100",
    "TextGenerateResponse": "repeated int32 output_ids = 100",
    "GenerateRequest": "optional bool return_text_in_logprobs = 100",
}

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {_F.TYPE_FLOAT: "float", _F.TYPE_DOUBLE: "double", _F.TYPE_INT32: "int32",
          _F.TYPE_INT64: "int64", _F.TYPE_UINT32: "uint32", _F.TYPE_UINT64: "uint64",
          _F.TYPE_BOOL: "bool", _F.TYPE_STRING: "string", _F.TYPE_BYTES: "bytes"}


def lines(spec: str) -> dict[str, str]:
    """A table entry -> {field number: its line, whitespace normalised}."""
    out = {}
    for line in spec.splitlines():
        line = " ".join(line.split())
        if line:
            out[line.split(" = ")[1].split()[0]] = line
    return out


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
