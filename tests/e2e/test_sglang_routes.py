"""SGLang's and vLLM's behaviour where their test suites look, against the real mesh: the
current route names (/model_info, /server_info, /v1/tokenize, /v1/detokenize, /v1/models/{id}),
SGLang's model facts, tokenizing the empty text, idempotent Abort and abort_all (CANCELLED
over gRPC, finish_reason abort over HTTP), GetLoad past the replicas, negative ids, and
/v1/score's error body."""

from __future__ import annotations

import json
import threading
import uuid

import grpc
import httpx
import pytest
from helpers import text_request

from sglang.runtime.v1 import sglang_pb2 as pb

SGLANG_MODEL_KEYS = {"model_path", "tokenizer_path", "is_generation", "weight_version",
                     "model_type", "architectures"}


@pytest.fixture(scope="module")
def http(mesh) -> httpx.Client:
    with httpx.Client(base_url=mesh.addresses.gateway_http, timeout=60) as client:
        yield client


# -- routes and facts --------------------------------------------------------------------------


def test_model_info_has_sglangs_keys_over_grpc_and_both_routes(http, stub):
    facts = json.loads(stub.GetModelInfo(pb.GetModelInfoRequest()).json_info)
    assert SGLANG_MODEL_KEYS <= set(facts)
    assert facts["is_generation"] is True and facts["architectures"] == ["LlamaForCausalLM"]
    assert facts["model_type"] == "llama" and facts["weight_version"] == "default"
    current, kept = http.get("/model_info").json(), http.get("/get_model_info").json()
    assert current == kept and SGLANG_MODEL_KEYS <= set(current)
    assert current["model_path"] == facts["model_path"] == current["tokenizer_path"]


def test_server_info_reports_the_kv_cache_in_tokens(http, stub):
    current, kept = http.get("/server_info").json(), http.get("/get_server_info").json()
    [state] = current["internal_states"]
    capacity = state["kv_blocks_total"] * state["kv_block_size"]
    assert current["max_total_num_tokens"] == capacity > 0
    assert kept["max_total_num_tokens"] == capacity
    facts = json.loads(stub.GetServerInfo(pb.GetServerInfoRequest()).json_info)
    assert facts["max_total_num_tokens"] == capacity


def test_v1_models_by_id(http):
    [card] = http.get("/v1/models").json()["data"]
    one = http.get(f"/v1/models/{card['id']}")
    assert one.status_code == 200 and one.json() == card
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


# -- tokenize ----------------------------------------------------------------------------------


def test_the_empty_text_tokenizes_over_grpc_and_http(http, stub):
    bare = stub.Tokenize(pb.TokenizeRequest(text="", add_special_tokens=False))
    assert list(bare.tokens) == [] and bare.count == 0
    special = stub.Tokenize(pb.TokenizeRequest(text=""))  # BOS only
    assert special.count == len(special.tokens) == 1
    for path in ("/tokenize", "/v1/tokenize"):
        r = http.post(path, json={"prompt": "", "add_special_tokens": False})
        assert r.status_code == 200 and r.json()["tokens"] == [] and r.json()["count"] == 0
    r = http.post("/v1/runtime/tokenize", json={"text": "", "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["count"] == 0


def test_v1_tokenize_and_detokenize_round_trip(http, stub):
    text = "Once upon a time"
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=text)).tokens)
    r = http.post("/v1/tokenize", json={"prompt": [text, "a"], "model": "any"}).json()
    assert r["tokens"][0] == ids and r["count"][0] == len(ids) and r["max_model_len"] > 0
    assert http.post("/v1/detokenize", json={"tokens": ids}).json() == {"text": text}
    assert http.post("/v1/detokenize", json={"tokens": []}).json() == {"text": ""}


def test_v1_tokenize_renders_a_chat(http, stub):
    messages = [{"role": "user", "content": "Hello there"}]
    open_turn = http.post("/v1/tokenize", json={"messages": messages}).json()
    closed = http.post("/v1/tokenize", json={"messages": messages,
                                             "add_generation_prompt": False}).json()
    assert open_turn["count"] == len(open_turn["tokens"]) > closed["count"] > 0
    assert open_turn["tokens"][:closed["count"]] == closed["tokens"]
    text = http.post("/v1/detokenize", json={"tokens": open_turn["tokens"],
                                             "skip_special_tokens": False}).json()["text"]
    assert "Hello there" in text
    r = http.post("/v1/tokenize", json={"messages": messages, "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # OpenAI's shape
    started = messages + [{"role": "assistant", "content": "Once upon"}]
    kept_open = http.post("/v1/tokenize", json={"messages": started,
                                                "continue_final_message": True}).json()
    assert kept_open["tokens"][:open_turn["count"]] == open_turn["tokens"]
    text = http.post("/v1/detokenize", json={"tokens": kept_open["tokens"]}).json()["text"]
    assert text.endswith("Once upon")  # the final message left open, to be continued
    r = http.post("/v1/tokenize", json={"messages": started, "continue_final_message": True,
                                        "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_negative_ids_are_refused_saying_non_negative(http, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Detokenize(pb.DetokenizeRequest(tokens=[5, -1]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-negative" in err.value.details()
    for path in ("/detokenize", "/v1/detokenize"):
        r = http.post(path, json={"tokens": [5, -1]})
        assert r.status_code == 400 and "non-negative" in r.text, r.text
    r = http.post("/detokenize", json={"tokens": [5, 10**6]})
    assert r.status_code == 400 and "out of vocabulary" in r.text


# -- abort and load ----------------------------------------------------------------------------


def test_get_load_past_the_replicas_is_empty(http, stub):
    assert json.loads(stub.GetLoad(pb.GetLoadRequest(dp_rank=7)).json_info) == []
    assert json.loads(stub.GetLoad(pb.GetLoadRequest(dp_rank=0)).json_info)[0]["dp_rank"] == 0
    assert http.get("/get_load", params={"dp_rank": 7}).json() == []
    assert http.get("/v1/runtime/load", params={"dp_rank": 7}).json() == {"json_info": "[]"}


def test_abort_is_idempotent_over_grpc_and_http(http, stub):
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    list(stub.TextGenerate(text_request("short", rid=rid, max_new_tokens=2)))  # finished
    reply, call = stub.Abort.with_call(pb.AbortRequest(rid=rid))
    assert reply.success and dict(call.trailing_metadata())["meshlm-aborted"] == "0"
    r = http.post("/v1/runtime/abort", json={"rid": rid})
    assert r.json() == {"success": True} and r.headers["meshlm-aborted"] == "0"


def test_abort_all_cancels_grpc_streams_and_ends_http_streams_with_abort(mesh, stub):
    """As SGLang's gRPC server: open gRPC streams end CANCELLED saying they were aborted; an
    HTTP /generate stream still ends with finish_reason abort."""
    grpc_call = stub.TextGenerate(text_request("grpc side", max_new_tokens=1500,
                                               ignore_eos=True))
    next(grpc_call)
    events: list[dict] = []
    started = threading.Event()

    def read_sse() -> None:
        body = {"text": "http side", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        with httpx.stream("POST", f"{mesh.addresses.gateway_http}/generate", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: "):]))
                    started.set()

    reader = threading.Thread(target=read_sse, daemon=True)
    reader.start()
    assert started.wait(60), "the HTTP stream never started"
    reply, call = stub.Abort.with_call(pb.AbortRequest(abort_all=True))
    assert reply.success and int(dict(call.trailing_metadata())["meshlm-aborted"]) >= 2
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_call)
    assert err.value.code() == grpc.StatusCode.CANCELLED and "aborted" in err.value.details()
    reader.join(60)
    assert not reader.is_alive(), "the HTTP stream did not end"
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"


# -- /v1/score ---------------------------------------------------------------------------------


def test_score_errors_use_sglangs_body(http):
    r = http.post("/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [-4]})
    assert r.status_code == 400
    body = r.json()
    assert body["object"] == "error" and body["code"] == 400
    assert body["type"] == "BadRequestError" and body["message"].startswith("label_token_ids[0]")
