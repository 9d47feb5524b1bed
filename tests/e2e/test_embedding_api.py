"""Embeddings end to end: Embed / TextEmbed over gRPC, transcoded HTTP and SGLang's /encode, on
an embedding-only checkpoint (a second, small mesh) and on the default causal LM."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from helpers import own_mesh

from meshlm.common.default_model import ensure_default_model
from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2 as pb
from sglang.runtime.v1 import sglang_pb2_grpc

transformers = pytest.importorskip("transformers")

HIDDEN = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def embedding_checkpoint(path: Path) -> None:
    """A tiny bare LlamaModel (no language-model head) with the default model's tokenizer."""
    import torch

    default = ensure_default_model()
    vocab = json.loads((default / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default / name, path / name)


@pytest.fixture(scope="module")
def embed_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model_path = tmp_path_factory.mktemp("embedder")
    embedding_checkpoint(model_path)
    with own_mesh(tmp_path_factory.mktemp("embed-mesh"), model_path=str(model_path)) as m:
        yield m


@pytest.fixture(scope="module")
def embed_stub(embed_mesh: Mesh) -> Iterator[sglang_pb2_grpc.SglangServiceStub]:
    with grpc.insecure_channel(embed_mesh.addresses.gateway_grpc) as ch:
        yield sglang_pb2_grpc.SglangServiceStub(ch)


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def test_text_embed_is_a_unit_vector_of_hidden_size_and_deterministic(embed_stub):
    first = embed_stub.TextEmbed(pb.TextEmbedRequest(text="The quick brown fox"), timeout=60)
    assert len(first.embedding) == HIDDEN
    assert abs(_norm(list(first.embedding)) - 1.0) < 1e-4
    meta = first.meta_info
    assert meta["id"] and int(meta["prompt_tokens"]) > 0 and "cached_tokens" in meta
    again = embed_stub.TextEmbed(pb.TextEmbedRequest(text="The quick brown fox", rid="emb-1"),
                                 timeout=60)
    assert _close(list(again.embedding), list(first.embedding), 1e-5)  # maybe prefix-cached
    assert again.meta_info["id"] == "emb-1"
    other = embed_stub.TextEmbed(pb.TextEmbedRequest(text="A different sentence"), timeout=60)
    assert not _close(list(other.embedding), list(first.embedding), 1e-3)
    # Embed with the same tokens gives the same vector.
    tokens = embed_stub.Tokenize(pb.TokenizeRequest(text="The quick brown fox")).tokens
    by_ids = embed_stub.Embed(pb.EmbedRequest(input_ids=tokens), timeout=60)
    assert _close(list(by_ids.embedding), list(first.embedding))
    assert by_ids.meta_info["prompt_tokens"] == meta["prompt_tokens"]


def test_grpc_and_http_give_the_same_vector(embed_mesh, embed_stub):
    text = "Embeddings over every transport"
    grpc_vec = list(embed_stub.TextEmbed(pb.TextEmbedRequest(text=text), timeout=60).embedding)
    base = embed_mesh.addresses.gateway_http
    transcoded = httpx.post(f"{base}/v1/runtime/text_embed", json={"text": text}, timeout=60)
    assert transcoded.status_code == 200, transcoded.text
    assert _close(transcoded.json()["embedding"], grpc_vec)
    native = httpx.post(f"{base}/encode", json={"text": text, "rid": "enc-1"}, timeout=60)
    assert native.status_code == 200, native.text
    body = native.json()
    assert _close(body["embedding"], grpc_vec)
    meta = body["meta_info"]
    assert meta["id"] == "enc-1" and meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0
    assert meta["finish_reason"] == {"type": "stop"}
    tokens = embed_stub.Tokenize(pb.TokenizeRequest(text=text)).tokens
    by_ids = httpx.post(f"{base}/encode", json={"input_ids": list(tokens)}, timeout=60)
    assert _close(by_ids.json()["embedding"], grpc_vec)


def test_embedding_errors(embed_mesh, embed_stub):
    with pytest.raises(grpc.RpcError) as err:
        embed_stub.TextEmbed(pb.TextEmbedRequest(text=""), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        embed_stub.Embed(pb.EmbedRequest(), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = httpx.post(f"{embed_mesh.addresses.gateway_http}/encode", json={"input_ids": []},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input_ids: ")
    # Too long for the context (256): the tokenizer refuses a text prompt.
    with pytest.raises(grpc.RpcError) as err:
        embed_stub.TextEmbed(pb.TextEmbedRequest(text="word " * 400), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_embedding_only_model_refuses_generation(embed_mesh, embed_stub):
    req = pb.TextGenerateRequest(text="hello", sampling_params=pb.SamplingParams(
        max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as err:
        list(embed_stub.TextGenerate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "embeddings only" in (err.value.details() or "")
    r = httpx.post(f"{embed_mesh.addresses.gateway_http}/generate",
                   json={"text": "hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "FAILED_PRECONDITION"


def test_causal_model_embeds_with_last_token_pooling(stub):
    info = json.loads(stub.GetModelInfo(pb.GetModelInfoRequest()).json_info)
    reply = stub.TextEmbed(pb.TextEmbedRequest(text="Once upon a time"), timeout=60)
    assert len(reply.embedding) == info["config"]["hidden_size"]
    assert abs(_norm(list(reply.embedding)) - 1.0) < 1e-4
    again = stub.TextEmbed(pb.TextEmbedRequest(text="Once upon a time"), timeout=60)
    assert _close(list(again.embedding), list(reply.embedding), 1e-4)
