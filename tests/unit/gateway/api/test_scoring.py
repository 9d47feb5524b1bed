"""Score, Rerank, Classify and OpenAIClassify over a fake gateway, as RPCs and as HTTP routes:
what each item runs as (max_new_tokens 1 and the label tokens' logprobs; embedding requests on
a classifier; the (query, document) pair), the scores folded from the engine's answers, the
ranking, labels and errors naming the client's fields."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.openai import OpenAIRPCs
from meshlm.gateway.api.scoring import RERANK_PROMPT, ScoringRPCs
from meshlm.gateway.api.tokens import TokenRPCs
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.scoring_results import softmax
from meshlm.gateway.protocol.validation import Limits, ValidatedRequest
from meshlm.v1 import common_pb2, gateway_pb2, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=64, vocab_size=100)
CTX = CallContext(metadata={}, peer="")
YES, NO = 11, 12
ID2LABEL = {"0": "negative", "1": "neutral", "2": "positive"}


def _logprob(prompt: str | list[int], token: int) -> float:
    """The fake engine's logprob of `token` after `prompt`."""
    return -((len(prompt) * (token % 5 + 1)) % 11) * 0.1 - 0.05


def _logits(text: str) -> list[float]:
    return [len(text) * 0.1, 0.5, -float(len(text) % 3)]


class FakeTokenizer:
    async def Tokenize(self, req: tokenizer_pb2.TokenizeRequest,
                       timeout: float) -> tokenizer_pb2.TokenizeResponse:
        assert not req.add_special_tokens
        return tokenizer_pb2.TokenizeResponse(tokens={" yes": [YES, 50], " no": [NO]}[req.text])


class FakeGateway(ScoringRPCs):
    """The scoring RPCs over a fake that is their core and generation path at once."""

    def __init__(self, architecture: str = "LlamaForCausalLM") -> None:
        self.identity = SimpleNamespace(served_model_name="tiny", tool_call_parser="",
                                        reasoning_parser="")
        config = {"architectures": [architecture], "id2label": ID2LABEL}
        self.model = common_pb2.ModelInfo(json_info=json.dumps({"config": config}))
        self.validated: list[ValidatedRequest] = []
        super().__init__(self, self, TokenRPCs(self))  # type: ignore[arg-type]

    async def limits(self) -> Limits:
        return LIMITS

    def tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    @staticmethod
    async def call(call: Any) -> Any:
        return await call

    async def generate(self, v: ValidatedRequest, express: object = None
                       ) -> AsyncIterator[tuple[Update, dict[str, str]]]:
        self.validated.append(v)
        prompt = v.text if v.text is not None else list(v.input_ids or [])
        if prompt == "long":
            raise MeshError(grpc.StatusCode.INVALID_ARGUMENT, "text: the prompt is too long")
        labels = list(v.sampling.token_ids_logprob)
        logprobs = common_pb2.Logprobs(output_logprobs=[-0.1], output_token_ids_logprobs=[
            common_pb2.TopLogprobs(token_ids=labels,
                                   logprobs=[_logprob(prompt, t) for t in labels])])
        final = gateway_pb2.TextOutput(finished=True, finish_reason="length")
        yield Update(text="", token_ids=[7], final=final, error=None, prompt_tokens=len(prompt),
                     completion_tokens=1, cached_tokens=0, logprobs=logprobs), {"id": "x"}

    async def embed(self, v: ValidatedRequest) -> tuple[Update, dict[str, str]]:
        self.validated.append(v)
        assert v.embed
        text = (v.text or "") + (v.text_pair or "") if v.input_ids is None else "ids"
        update = Update(text="", token_ids=[], final=None, error=None, prompt_tokens=len(text),
                        completion_tokens=0, cached_tokens=0, embedding=_logits(text))
        return update, {"id": "e1", "prompt_tokens": str(len(text))}


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


async def _score(gw: FakeGateway, **body: Any) -> dict[str, Any]:
    reply = await gw.Score(pb.OpenAIRequest(json_body=orjson.dumps(body)), CTX)
    assert reply.status_code == 200
    return dict(orjson.loads(reply.json_body))


async def test_score_text_items_are_query_plus_item_with_label_probabilities() -> None:
    gw = FakeGateway()
    body = await _score(gw, query="Is it ", items=["red?", "a long item?"],
                        label_token_ids=[5, 9], model="tiny")
    assert body["object"] == "scoring" and body["model"] == "tiny"
    prompts = ["Is it red?", "Is it a long item?"]
    assert [v.text for v in gw.validated] == prompts
    for v in gw.validated:
        s = v.sampling
        assert (s.max_new_tokens, s.temperature, s.return_logprob) == (1, 0.0, True)
        assert list(s.token_ids_logprob) == [5, 9] and not v.return_text and v.embed is False
    expected = [[math.exp(_logprob(p, t)) for t in (5, 9)] for p in prompts]
    assert _flat(body["scores"]) == pytest.approx(_flat(expected))
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    # apply_softmax: renormalised over the labels; item_first: item + query.
    gw = FakeGateway()
    body = await _score(gw, query="Q", items="item ", label_token_ids=[5, 9],
                        apply_softmax=True, item_first=True)
    assert gw.validated[0].text == "item Q"
    [scores] = body["scores"]
    assert scores == pytest.approx(softmax([_logprob("item Q", 5), _logprob("item Q", 9)]))
    assert sum(scores) == pytest.approx(1.0)


async def test_score_token_ids() -> None:
    gw = FakeGateway()
    body = await _score(gw, query=[1, 2], items=[[3], [4, 5]], label_token_ids=[7])
    assert [v.input_ids for v in gw.validated] == [[1, 2, 3], [1, 2, 4, 5]]
    assert _flat(body["scores"]) == pytest.approx([math.exp(_logprob([1, 2, 3], 7)),
                                                   math.exp(_logprob([1, 2, 4, 5], 7))])
    gw = FakeGateway()
    await _score(gw, query=[1], items=[[3]], label_token_ids=[7], item_first=True)
    assert gw.validated[0].input_ids == [3, 1]


@pytest.mark.parametrize(("body", "message"), [
    ({"query": "q", "items": ["a"], "label_token_ids": [5, 100]},
     "label_token_ids[1]: token id 100 is out of range [0, 100)"),
    ({"query": [1], "items": [[2], [3, 200]], "label_token_ids": [5]},
     "items[1][1]: token id 200 is out of range [0, 100)"),
    ({"query": [1], "items": [[2] * 70], "label_token_ids": [5]},
     "items[0]: the prompt is 71 tokens, which is longer than the model's context length"),
    ({"query": "q", "items": ["long"[:0] + "long"], "label_token_ids": [5]}, None),
    ({"query": "", "items": ["long"], "label_token_ids": [5]},
     "items[0]: the prompt is too long"),
    ({"query": "q", "items": [], "label_token_ids": [5]}, "items: must be"),
    ({"query": "q", "items": ["a"]}, "label_token_ids: is required"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids: must be"),
    ({"query": [1], "items": ["a"], "label_token_ids": [5]}, "query: must be a string"),
    ({"query": "q", "items": ["a", [1]], "label_token_ids": [5]}, "items[1]: must be a string"),
    ({"items": [""], "label_token_ids": [5]}, "items[0]: query + item is empty"),
    ({"query": "q", "items": ["a"], "label_token_ids": [5], "model": "other"},
     "model: the model `other` does not exist"),
    ({"query": "q", "items": ["a"], "label_token_ids": [5], "bogus": 1},
     "bogus: unknown field"),
])
async def test_score_errors_name_the_field(body: dict[str, Any], message: str | None) -> None:
    gw = FakeGateway()
    if message is None:  # "qlong" is an ordinary prompt
        await _score(gw, **body)
        return
    with pytest.raises(MeshError) as err:
        await _score(gw, **body)
    assert err.value.message.startswith(message), err.value.message
    assert err.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


async def _rerank(gw: FakeGateway, **body: Any) -> list[dict[str, Any]]:
    reply = await gw.Rerank(pb.OpenAIRequest(json_body=orjson.dumps(body)), CTX)
    return list(orjson.loads(reply.json_body))


def _yes_score(prompt: str, yes: int = YES, no: int = NO) -> float:
    p_yes, p_no = math.exp(_logprob(prompt, yes)), math.exp(_logprob(prompt, no))
    return p_yes / (p_yes + p_no)


async def test_rerank_generative_scores_yes_against_no_best_first() -> None:
    gw = FakeGateway()
    docs = ["a", "bbb", "cc", "dddd"]
    results = await _rerank(gw, query="q?", documents=docs)
    prompts = [RERANK_PROMPT.format(query="q?", document=d) for d in docs]
    assert [v.text for v in gw.validated] == prompts
    assert all(list(v.sampling.token_ids_logprob) == [YES, NO] for v in gw.validated)
    scores = [_yes_score(p) for p in prompts]
    order = sorted(range(4), key=lambda i: -scores[i])
    assert [r["index"] for r in results] == order
    assert [r["score"] for r in results] == pytest.approx([scores[i] for i in order])
    assert [r["document"] for r in results] == [docs[i] for i in order]
    # top_n, return_documents false, labels given by the client.
    gw = FakeGateway()
    results = await _rerank(gw, query="q?", documents=docs, top_n=2, return_documents=False,
                            label_token_ids=[30, 40])
    assert len(results) == 2 and all("document" not in r for r in results)
    assert all(list(v.sampling.token_ids_logprob) == [30, 40] for v in gw.validated)
    assert results[0]["score"] == pytest.approx(max(_yes_score(p, 30, 40) for p in prompts))


async def test_rerank_cross_encoder_pairs_query_and_document() -> None:
    gw = FakeGateway("Qwen2ForSequenceClassification")
    docs = ["one", "three", "fives"]
    results = await _rerank(gw, query="q", documents=docs)
    assert [(v.text, v.text_pair, v.embed) for v in gw.validated] == [
        ("q", d, True) for d in docs]
    scores = [softmax(_logits("q" + d))[-1] for d in docs]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -scores[i])
    assert {r["index"]: r["score"] for r in results} == pytest.approx(dict(enumerate(scores)))
    with pytest.raises(MeshError, match="label_token_ids: is for generative"):
        await _rerank(gw, query="q", documents=docs, label_token_ids=[1, 2])


@pytest.mark.parametrize(("body", "message"), [
    ({"query": "", "documents": ["a"]}, "query: must be a non-empty string"),
    ({"query": "q", "documents": []}, "documents: must be a non-empty list"),
    ({"query": "q", "documents": ["a", " "]}, "documents[1]: must be a non-empty string"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n: must be in [1,"),
    ({"query": "q", "documents": ["a"], "label_token_ids": [1]}, "label_token_ids: must be two"),
    ({"query": "q", "documents": ["a"], "label_token_ids": [1, 100]},
     "label_token_ids[1]: token id 100 is out of range"),
    ({"query": "q", "documents": ["long"], "instruct": "x"}, "instruct: is not supported"),
])
async def test_rerank_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(MeshError) as err:
        await _rerank(FakeGateway(), **body)
    assert err.value.message.startswith(message), err.value.message


async def test_classify_returns_logits_on_a_classifier_only() -> None:
    gw = FakeGateway("LlamaForSequenceClassification")
    reply = await gw.Classify(pb.ClassifyRequest(text="hello"), CTX)
    assert list(reply.embedding) == pytest.approx(_logits("hello"))
    assert reply.meta_info["id"] == "e1"
    [v] = gw.validated
    assert v.embed and v.text == "hello"
    reply = await gw.Classify(pb.ClassifyRequest(input_ids=[4, 5]), CTX)
    assert gw.validated[-1].input_ids == [4, 5]
    with pytest.raises(MeshError) as err:
        await gw.Classify(pb.ClassifyRequest(text="a", input_ids=[1]), CTX)
    assert err.value.message.startswith("input_ids: give text or input_ids, not both")
    with pytest.raises(MeshError) as err:
        await gw.Classify(pb.ClassifyRequest(input_ids=[100]), CTX)
    assert err.value.message.startswith("input_ids[0]: token id 100")
    with pytest.raises(MeshError) as err:
        await FakeGateway().Classify(pb.ClassifyRequest(text="hello"), CTX)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "sequence-classification checkpoint" in err.value.message
    assert "LlamaForCausalLM" in err.value.message


async def test_openai_classify_softmax_and_labels() -> None:
    gw = FakeGateway("MistralForSequenceClassification")
    body = orjson.dumps({"model": "tiny", "input": ["good", "a longer input"]})
    reply = await gw.OpenAIClassify(pb.OpenAIRequest(json_body=body), CTX)
    out = orjson.loads(reply.json_body)
    assert out["object"] == "list" and out["model"] == "tiny" and out["id"].startswith("classify-")
    for i, text in enumerate(["good", "a longer input"]):
        data = out["data"][i]
        logits = _logits(text)
        assert data["index"] == i and data["num_classes"] == 3
        assert data["probs"] == pytest.approx(softmax(logits))
        assert data["label"] == ID2LABEL[str(logits.index(max(logits)))]
    assert out["usage"] == {"prompt_tokens": 18, "completion_tokens": 0, "total_tokens": 18,
                            "prompt_tokens_details": None}
    one = orjson.loads((await gw.OpenAIClassify(pb.OpenAIRequest(
        json_body=orjson.dumps({"input": [3, 4], "rid": "c-1"})), CTX)).json_body)
    assert one["id"] == "classify-c-1" and gw.validated[-1].rid == "c-1"
    assert gw.validated[-1].input_ids == [3, 4]


# ---- over HTTP -------------------------------------------------------------------------------


@pytest.fixture
def gw() -> FakeGateway:
    return FakeGateway()


async def _client(gw: FakeGateway) -> httpx.AsyncClient:
    api = SimpleNamespace(scoring=gw, openai=OpenAIRPCs(gw, gw, gw.tokens))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=build_http_app(api))
    return httpx.AsyncClient(transport=transport, base_url="http://gw")


async def test_http_routes_answer_as_the_rpcs() -> None:
    gw = FakeGateway()
    async with await _client(gw) as c:
        score = {"query": "q", "items": ["a", "b"], "label_token_ids": [5]}
        r = await c.post("/v1/score", json=score)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == await _score(FakeGateway(), **score)
        rerank = {"query": "q", "documents": ["a", "bb"]}
        r = await c.post("/v1/rerank", json=rerank)
        assert r.status_code == 200 and r.json() == await _rerank(FakeGateway(), **rerank)
        r = await c.post("/v1/score", json={"query": "q", "items": ["a"],
                                            "label_token_ids": [5, 100]})
        assert r.status_code == 400  # SGLang's top-level ErrorResponse on /v1/score
        error = r.json()
        assert error["message"].startswith("label_token_ids[1]: ")
        assert (error["object"], error["type"], error["code"]) == ("error", "BadRequestError", 400)
        r = await c.post("/v1/classify", json={"input": "hi"})
        assert r.status_code == 400 and "sequence-classification" in r.json()["error"]["message"]
    gw = FakeGateway("LlamaForSequenceClassification")
    async with await _client(gw) as c:
        r = await c.post("/v1/classify", json={"input": "hi"})
        assert r.status_code == 200 and r.json()["data"][0]["probs"] == pytest.approx(
            softmax(_logits("hi")))
        r = await c.post("/v1/classify", json={"input": ["a", ""]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]"
