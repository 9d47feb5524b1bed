"""Score, Rerank and Classify end to end, over gRPC (generated stubs) and HTTP, against
transformers on the same checkpoints: the default tiny Llama (the session mesh) for label-token
scoring and generative reranking, and a second mesh on a tiny LlamaForSequenceClassification
(the default model's tokenizer) for class logits, OpenAI classify and cross-encoder reranking."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from meshlm.common.default_model import PAD_TOKEN, ensure_default_model
from meshlm.gateway.api.scoring import RERANK_PROMPT
from meshlm.launch.mesh import Mesh, MeshOptions
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

TOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ID2LABEL = {0: "negative", 1: "neutral", 2: "positive"}


def _openai(call: Any, body: dict[str, Any]) -> Any:
    reply = call(pb.OpenAIRequest(json_body=json.dumps(body).encode()), timeout=120)
    assert reply.status_code == 200
    return json.loads(reply.json_body)


def _ids(stub: sglang_pb2_grpc.SglangServiceStub, text: str, special: bool = True) -> list[int]:
    """The mesh's own tokenization of `text`."""
    req = pb.TokenizeRequest(text=text, add_special_tokens=special)
    return list(stub.Tokenize(req, timeout=30).tokens)


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= TOL for a, b in zip(got, want, strict=True))


def _close_probs(got: list[float], want: list[float]) -> bool:
    """Probabilities equal to TOL relative (small ones included): their logs to TOL."""
    return len(got) == len(want) and all(
        abs(math.log(a) - math.log(b)) <= TOL for a, b in zip(got, want, strict=True))


# ---- the default causal LM: Score and generative Rerank --------------------------------------


@pytest.fixture(scope="module")
def causal_lm(stub: sglang_pb2_grpc.SglangServiceStub) -> Any:
    path = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model_path
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager").eval()


def _next_probs(model: Any, ids: list[int]) -> Any:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)


def test_score_is_the_label_tokens_probability(mesh, stub, causal_lm) -> None:
    query, items = "The capital of France is", [" Paris", " London", " a big city"]
    top = int(_next_probs(causal_lm, _ids(stub, query + items[0])).argmax())
    labels = [top, _ids(stub, " Paris", False)[0], 5, 1000, 2047]
    body = {"query": query, "items": items, "label_token_ids": labels}
    scores = _openai(stub.Score, body)
    assert scores["object"] == "scoring" and len(scores["scores"]) == len(items)
    softmaxed = _openai(stub.Score, {**body, "apply_softmax": True})["scores"]
    for item, got, renormalised in zip(items, scores["scores"], softmaxed, strict=True):
        probs = _next_probs(causal_lm, _ids(stub, query + item))[labels]
        assert _close_probs(got, probs.tolist()), (item, got, probs)
        assert _close(renormalised, (probs / probs.sum()).tolist())
    assert scores["usage"]["prompt_tokens"] == sum(len(_ids(stub, query + i)) for i in items)
    # The same over HTTP.
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/score", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert all(_close_probs(a, b) for a, b in zip(r.json()["scores"], scores["scores"],
                                                  strict=True))


def test_score_token_ids_and_item_first(stub, causal_lm) -> None:
    query, items = _ids(stub, "Once upon"), [[300, 301], [7], [1200, 5, 9]]
    labels = [3, 42]
    first = _openai(stub.Score, {"query": query, "items": items, "label_token_ids": labels,
                                 "item_first": True})
    for item, got in zip(items, first["scores"], strict=True):
        assert _close_probs(got, _next_probs(causal_lm, item + query)[labels].tolist())
    after = _openai(stub.Score, {"query": query, "items": items, "label_token_ids": labels})
    for item, got in zip(items, after["scores"], strict=True):
        assert _close_probs(got, _next_probs(causal_lm, query + item)[labels].tolist())


def test_score_errors(mesh, stub) -> None:
    vocab = json.loads(stub.GetModelInfo(pb.GetModelInfoRequest()).json_info)["config"][
        "vocab_size"]
    with pytest.raises(grpc.RpcError) as err:
        _openai(stub.Score, {"query": "a", "items": ["b"], "label_token_ids": [1, vocab]})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("label_token_ids[1]: ")
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/score",
                   json={"query": "a", "items": [], "label_token_ids": [1]}, timeout=60)
    # SGLang's body for /v1/score: a top-level ErrorResponse, its message naming the field.
    assert r.status_code == 400 and r.json()["message"].startswith("items: ")
    assert (r.json()["object"], r.json()["type"], r.json()["code"]) == (
        "error", "BadRequestError", 400)
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/score",
                   json={"query": "a", "items": ["word " * 3000], "label_token_ids": [1]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["message"].startswith("items[0]: ")


def test_rerank_generative_orders_by_yes_over_no(mesh, stub, causal_lm) -> None:
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow.",
            "The Eiffel tower is in Paris.", "Berlin is in Germany."]
    yes, no = _ids(stub, " yes", False)[0], _ids(stub, " no", False)[0]
    expected = []
    for doc in docs:
        probs = _next_probs(causal_lm, _ids(stub, RERANK_PROMPT.format(query=query,
                                                                      document=doc)))
        expected.append(float(probs[yes] / (probs[yes] + probs[no])))
    results = _openai(stub.Rerank, {"query": query, "documents": docs})
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -expected[i])
    for r in results:
        assert abs(r["score"] - expected[r["index"]]) <= TOL
        assert r["document"] == docs[r["index"]]
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/rerank",
                   json={"query": query, "documents": docs, "top_n": 2,
                         "return_documents": False}, timeout=120)
    assert r.status_code == 200, r.text
    top = r.json()
    assert [t["index"] for t in top] == [t["index"] for t in results[:2]]
    assert all("document" not in t for t in top)
    # label_token_ids [yes, no] swapped: the complementary probability.
    swapped = _openai(stub.Rerank, {"query": query, "documents": docs,
                                    "label_token_ids": [no, yes]})
    assert all(abs(s["score"] - (1 - expected[s["index"]])) <= TOL for s in swapped)


def test_classify_needs_a_classifier(mesh, stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _openai(stub.OpenAIClassify, {"input": "hello"})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "LlamaForCausalLM" in (err.value.details() or "")
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/classify", json={"input": "hi"},
                   timeout=60)
    assert r.status_code == 400 and "sequence-classification" in r.json()["error"]["message"]


# ---- a sequence classifier: Classify, OpenAIClassify, cross-encoder Rerank ------------------


def _classifier_checkpoint(path: Path) -> Any:
    """A tiny LlamaForSequenceClassification (3 labels) with the default model's tokenizer."""
    default = ensure_default_model()
    vocab = json.loads((default / "config.json").read_text())["vocab_size"]
    pad = tokenizers.Tokenizer.from_file(str(default / "tokenizer.json")).token_to_id(PAD_TOKEN)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
        initializer_range=0.2, id2label=ID2LABEL, pad_token_id=pad)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager").eval()
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default / name, path / name)
    return model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Any, Path]]:
    model_path = tmp_path_factory.mktemp("classifier")
    model = _classifier_checkpoint(model_path)
    m = Mesh(MeshOptions(workdir=tmp_path_factory.mktemp("classifier-mesh"),
                         model_path=str(model_path), http_port=0, grpc_port=0,
                         env={"MESHLM_NUM_THREADS": "1"}))
    try:
        m.start()
        yield m, model, model_path
    finally:
        m.stop()


@pytest.fixture(scope="module")
def cls_stub(classifier) -> Iterator[sglang_pb2_grpc.SglangServiceStub]:
    with grpc.insecure_channel(classifier[0].addresses.gateway_grpc) as ch:
        yield sglang_pb2_grpc.SglangServiceStub(ch)


def _hf_logits(model: Any, ids: list[int]) -> list[float]:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float().tolist()


def test_classify_logits_match_transformers(classifier, cls_stub) -> None:
    mesh, model, _ = classifier
    pad = model.config.pad_token_id
    for text in ("I loved this film", "Terrible service, never again.", "ok"):
        ids = _ids(cls_stub, text)
        want = _hf_logits(model, ids)
        reply = cls_stub.Classify(pb.ClassifyRequest(text=text), timeout=60)
        assert _close(list(reply.embedding), want), (text, list(reply.embedding), want)
        assert int(reply.meta_info["prompt_tokens"]) == len(ids)
        padded = cls_stub.Classify(pb.ClassifyRequest(input_ids=ids + [pad, pad]), timeout=60)
        assert _close(list(padded.embedding), _hf_logits(model, ids + [pad, pad]))
        assert _close(list(padded.embedding), want)  # pooled at the last non-pad token
    transcoded = httpx.post(f"{mesh.addresses.gateway_http}/v1/runtime/classify",
                            json={"text": "ok"}, timeout=60)
    assert transcoded.status_code == 200, transcoded.text
    assert _close(transcoded.json()["embedding"], _hf_logits(model, _ids(cls_stub, "ok")))


def test_openai_classify_probs_and_labels(classifier, cls_stub) -> None:
    mesh, model, _ = classifier
    texts = ["I loved this film", "Terrible service, never again."]
    body = _openai(cls_stub.OpenAIClassify, {"input": texts})
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/classify", json={"input": texts},
                   timeout=60)
    assert r.status_code == 200, r.text
    for reply in (body, r.json()):
        assert reply["object"] == "list" and reply["id"].startswith("classify-")
        for i, text in enumerate(texts):
            logits = _hf_logits(model, _ids(cls_stub, text))
            probs = torch.tensor(logits).softmax(-1).tolist()
            data = reply["data"][i]
            assert data["index"] == i and data["num_classes"] == 3
            assert _close(data["probs"], probs)
            assert data["label"] == ID2LABEL[max(range(3), key=lambda k: logits[k])]
        assert reply["usage"]["prompt_tokens"] == sum(len(_ids(cls_stub, t)) for t in texts)


def test_rerank_cross_encoder_matches_transformers(classifier, cls_stub) -> None:
    mesh, model, path = classifier
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    query = "best pizza in town"
    docs = ["Luigi's serves wood-fired pizza.", "The library opens at nine.",
            "Pizza, pasta and more.", "Parking is free on Sundays."]
    expected = []
    for doc in docs:
        ids = tok.encode(query, doc).ids  # transformers' tokenizer(query, doc)
        expected.append(torch.tensor(_hf_logits(model, ids)).softmax(-1)[-1].item())
    for results in (_openai(cls_stub.Rerank, {"query": query, "documents": docs}),
                    httpx.post(f"{mesh.addresses.gateway_http}/v1/rerank",
                               json={"query": query, "documents": docs}, timeout=60).json()):
        assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -expected[i])
        assert all(abs(r["score"] - expected[r["index"]]) <= TOL for r in results)


def test_classifier_refuses_generation_and_scoring(cls_stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _openai(cls_stub.Score, {"query": "a", "items": ["b"], "label_token_ids": [1]})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        list(cls_stub.TextGenerate(pb.TextGenerateRequest(
            text="hi", sampling_params=pb.SamplingParams(max_new_tokens=2)), timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
