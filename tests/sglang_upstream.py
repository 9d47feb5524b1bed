"""SGLang's public proto as upstream has it on its main branch (proto/sglang/runtime/v1/
sglang.proto of sgl-project/sglang), written down here, not fetched: the drift test compares
meshlm's descriptors with it field by field, and the client-era test builds an upstream client
and an RFC-era one (the first version's numbers) from it. When upstream changes, change this
and the proto together."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "sglang.runtime.v1"

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

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE, "int32": _F.TYPE_INT32,
            "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32, "uint64": _F.TYPE_UINT64,
            "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES}

# The RFC's first version, where upstream has since moved fields: no seed or guided decoding,
# disaggregated_params at 13 / 12 and nothing after it.
RFC_LAST = {"SamplingParams": 15, "TextGenerateRequest": 12, "GenerateRequest": 11}
RFC_ADDED = {"TextGenerateRequest": "optional DisaggregatedParams disaggregated_params = 13",
             "GenerateRequest": "optional DisaggregatedParams disaggregated_params = 12"}


def lines(spec: str) -> dict[str, str]:
    """A table entry -> {field number: its line, whitespace normalised}."""
    out = {}
    for line in spec.splitlines():
        line = " ".join(line.split())
        if line:
            out[line.split(" = ")[1].split()[0]] = line
    return out


def rfc_era() -> dict[str, str]:
    """The RFC-era table: upstream's, cut back where fields moved since."""
    out = dict(UPSTREAM)
    for name, last in RFC_LAST.items():
        kept = [line for number, line in lines(UPSTREAM[name]).items() if int(number) <= last]
        out[name] = "\n".join([*kept, RFC_ADDED.get(name, "")])
    return out


def client_types(era: str, messages: dict[str, str]) -> dict[str, Any]:
    """Message classes of one client generation, from a table in UPSTREAM's format. proto2
    syntax: every singular field has presence (the wire is proto3's); a oneof's members are
    plain optional fields to a client; deprecation does not change the wire."""
    file = descriptor_pb2.FileDescriptorProto(name=f"{era}.proto", package=PACKAGE,
                                              syntax="proto2")
    for name, spec in messages.items():
        msg = file.message_type.add(name=name)
        for line in lines(spec).values():
            words = line.replace(" deprecated", "").split()
            kind, field, number = words[-4], words[-3], int(words[-1])
            f = msg.field.add(name=field, number=number, label=_F.LABEL_OPTIONAL)
            if kind.startswith("map<"):
                entry = msg.nested_type.add(name=field.title().replace("_", "") + "Entry")
                entry.options.map_entry = True
                for i, part in enumerate(("key", "value"), 1):
                    entry.field.add(name=part, number=i, label=_F.LABEL_OPTIONAL,
                                    type=_F.TYPE_STRING)
                f.label, f.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{name}.{entry.name}"
                continue
            if kind in _SCALARS:
                f.type = _SCALARS[kind]
            else:
                f.type, f.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{kind}"
            if words[0] == "repeated":
                f.label = _F.LABEL_REPEATED
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(
        f"{PACKAGE}.{name}")) for name in messages}
