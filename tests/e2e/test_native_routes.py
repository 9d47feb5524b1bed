"""SGLang-native routes against the real mesh: /health_generate, /get_model_info,
/get_server_info, /get_load, /abort_request, /tokenize, /detokenize (pause and continue are in
test_pause_generation.py), checked by what they answer, errors naming the field."""

from __future__ import annotations

import threading
import uuid

import grpc
import httpx
import pytest
from helpers import gateway_load, text_request, wait_until

from sglang.runtime.v1 import sglang_pb2 as pb

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(mesh) -> httpx.Client:
    with httpx.Client(base_url=mesh.addresses.gateway_http, timeout=60) as client:
        yield client


def _error(r: httpx.Response, status: int, field: str) -> str:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: "), message
    return message


class Running:
    """A long streaming gRPC request, drained in a thread so that it can be ended from here."""

    def __init__(self, stub, text: str) -> None:
        self.rid = f"native-{uuid.uuid4().hex[:8]}"
        self.stream = stub.TextGenerate(text_request(text, rid=self.rid, **LONG))
        self.first = next(self.stream)
        self.messages: list[pb.TextGenerateResponse] = [self.first]
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            self.messages.extend(self.stream)
        except grpc.RpcError as e:
            self.error = e

    def code(self) -> grpc.StatusCode | None:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the stream did not end"
        return self.error.code() if self.error is not None else None

    def finish_reason(self) -> str:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the stream did not end"
        return self.messages[-1].meta_info["finish_reason"]


# -- health and facts --------------------------------------------------------------------------


def test_health_generate_runs_a_real_generation(http, stub):
    before = gateway_load(stub)["generated_tokens_total"]
    r = http.get("/health_generate")
    assert r.status_code == 200 and r.content == b""
    assert gateway_load(stub)["generated_tokens_total"] >= before + 1
    assert http.post("/health_generate").status_code == 405


def test_get_model_info_describes_the_checkpoint(http, stub):
    info = http.get("/get_model_info").json()
    assert info["model_path"] == stub.GetModelInfo(pb.GetModelInfoRequest()).model_path
    assert info["tokenizer_path"] == info["model_path"]
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    assert info["max_model_len"] == stub.Tokenize(pb.TokenizeRequest(text="x")).max_model_len
    assert info["weight_version"] == "default" and info["preferred_sampling_params"] is None


def test_get_server_info_has_the_gateway_and_each_scheduler(mesh, http):
    info = http.get("/get_server_info").json()
    assert info["gateway"] == mesh.addresses.gateway_inbox
    assert info["served_model_name"] and info["max_model_len"] > 0
    assert info["version"] == "0.1.0"
    [state] = info["internal_states"]
    assert state["address"] == mesh.addresses.scheduler and state["dp_rank"] == 0
    assert state["paused"] is None and state["max_running"] > 0


def test_get_load_counts_requests_per_scheduler(mesh, http, stub):
    running = Running(stub, "Keep me busy")
    try:
        wait_until(lambda: http.get("/get_load").json()[0]["num_reqs"] == 1,
                   what="one request in the load")
        [load] = http.get("/get_load", params={"dp_rank": 0}).json()
        assert load["dp_rank"] == 0 and load["address"] == mesh.addresses.scheduler
        assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["num_tokens"] > 0 and 0 < load["token_usage"] <= 1
        assert load["paused"] is None
    finally:
        stub.Abort(pb.AbortRequest(rid=running.rid))
    assert running.finish_reason() == "abort"
    assert http.get("/get_load", params={"dp_rank": 3}).json() == []  # none there, as SGLang
    _error(http.get("/get_load", params={"dp_rank": "one"}), 400, "dp_rank")
    _error(http.get("/get_load", params={"rank": 0}), 400, "rank")


# -- abort -------------------------------------------------------------------------------------


def test_abort_request_by_rid_ends_the_stream(http, stub):
    running = Running(stub, "Abort me over HTTP")
    r = http.post("/abort_request", json={"rid": running.rid})
    assert r.status_code == 200 and r.json() == {"success": True, "aborted": 1}
    assert running.finish_reason() == "abort"
    assert int(running.messages[-1].meta_info["completion_tokens"]) < LONG["max_new_tokens"]
    unknown = http.post("/abort_request", json={"rid": f"nope-{uuid.uuid4().hex}"})
    assert unknown.status_code == 200 and unknown.json() == {"success": True, "aborted": 0}


def test_abort_request_all_ends_every_stream(http, stub):
    runs = [Running(stub, "One"), Running(stub, "Two")]
    r = http.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json()["success"] and r.json()["aborted"] >= 2
    assert [run.code() for run in runs] == [grpc.StatusCode.CANCELLED] * 2


def test_abort_request_errors_name_the_field(http):
    _error(http.post("/abort_request", json={}), 400, "rid")
    _error(http.post("/abort_request", json={"rid": 7}), 400, "rid")
    _error(http.post("/abort_request", json={"abort_all": "yes"}), 400, "abort_all")
    _error(http.post("/abort_request", json={"rdi": "x"}), 400, "rdi")
    bad = http.post("/abort_request", content=b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    _error(http.post("/abort_request", json=["x"]), 400, "body")


# -- tokenize / detokenize ---------------------------------------------------------------------


def test_tokenize_matches_the_rpc(http, stub):
    text = "Héllo, wörld! 你好"
    want = stub.Tokenize(pb.TokenizeRequest(text=text))
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200
    assert r.json() == {"tokens": list(want.tokens), "count": want.count,
                        "max_model_len": want.max_model_len}
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                         "model": "any"}).json()
    assert plain["tokens"] == list(want.tokens)[1:] and plain["count"] == want.count - 1
    batch = http.post("/tokenize", json={"prompt": [text, "a b"]}).json()
    assert batch["tokens"][0] == list(want.tokens)
    assert batch["count"] == [want.count, len(batch["tokens"][1])]
    assert batch["max_model_len"] == want.max_model_len


def test_detokenize_round_trips_and_skips_special_tokens(http, stub):
    text = "Once upon a time, 你好"
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=text)).tokens)  # BOS first
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"text": text}
    kept = http.post("/detokenize", json={"tokens": ids, "skip_special_tokens": False}).json()
    assert kept["text"] == stub.Detokenize(pb.DetokenizeRequest(tokens=ids)).text
    assert kept["text"].endswith(text) and kept["text"] != text
    batch = http.post("/detokenize", json={"tokens": [ids, ids[1:3]]}).json()
    assert batch["text"][0] == text and text.startswith(batch["text"][1])
    assert http.post("/detokenize", json={"tokens": []}).json() == {"text": ""}


def test_tokenize_and_detokenize_errors_name_the_field(http):
    _error(http.post("/tokenize", json={}), 400, "prompt")
    _error(http.post("/tokenize", json={"prompt": 5}), 400, "prompt")
    _error(http.post("/tokenize", json={"prompt": []}), 400, "prompt")
    _error(http.post("/tokenize", json={"prompt": ["a", 3]}), 400, "prompt[1]")
    _error(http.post("/tokenize", json={"prompt": "a", "add_special_tokens": 1}), 400,
           "add_special_tokens")
    _error(http.post("/tokenize", json={"text": "a"}), 400, "text")
    _error(http.post("/tokenize", json={"prompt": "a", "model": 5}), 400, "model")
    _error(http.post("/detokenize", json={}), 400, "tokens")
    _error(http.post("/detokenize", json={"tokens": "12"}), 400, "tokens")
    _error(http.post("/detokenize", json={"tokens": [1, "a"]}), 400, "tokens[1]")
    _error(http.post("/detokenize", json={"tokens": [1, True]}), 400, "tokens[1]")
    _error(http.post("/detokenize", json={"tokens": [1, -1]}), 400, "tokens[1]")
    _error(http.post("/detokenize", json={"tokens": [[5], [6, 2**40]]}), 400, "tokens[1][1]")
    vocab = _error(http.post("/detokenize", json={"tokens": [[5], [6, 10**8]]}), 400,
                   "tokens[1][1]")
    assert "out of range [0, " in vocab  # the vocabulary check, in the gateway
    assert http.get("/tokenize").status_code == 405
