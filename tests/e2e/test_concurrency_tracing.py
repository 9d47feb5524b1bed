"""64 concurrent greedy streams give each prompt's solo text; one trace per request spans all
four services, parented along the request's path; HTTP streams trace without error lines."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from helpers import collect_text, text_request

from meshlm.scheduler.models.loader import load_model
from sglang.runtime.v1 import sglang_pb2 as pb

WORDS = ("river mountain quiet lantern copper garden winter signal harbor meadow engine "
         "silver thunder orchard paper candle").split()


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + i % 9)) for i in range(n)]


def _tie_at_divergence(stub, model_path: str, prompt: str, alone: str, together: str) -> bool:
    """True when the first token where the two texts part is a near-tie (top-2 logits within
    1e-4) in a cache-free reference forward pass of the same model."""
    model, _ = load_model(model_path, device="cpu", dtype=torch.float32)
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=prompt)).tokens)
    n_prompt = len(ids)
    for _ in range(64):
        with torch.inference_mode():
            logits = model.forward_full(torch.tensor([ids]))[0, -1]
        top2 = torch.topk(logits, 2)
        nxt = int(top2.indices[0])
        text = stub.Detokenize(pb.DetokenizeRequest(tokens=ids[n_prompt:] + [nxt])).text
        if not together.startswith(text) or not alone.startswith(text):
            gap = float(top2.values[0] - top2.values[1])
            return gap <= 1e-4
        ids.append(nxt)
    return False


def test_64_concurrent_greedy_streams_match_solo(stub):
    prompts = _prompts(64)
    kwargs = {"max_new_tokens": 24, "ignore_eos": True}
    alone = [collect_text(stub, text_request(p, **kwargs))[0] for p in prompts]
    with ThreadPoolExecutor(max_workers=64) as pool:
        together = list(pool.map(lambda p: collect_text(stub, text_request(p, **kwargs))[0],
                                 prompts))
    model_path = stub.GetModelInfo(pb.GetModelInfoRequest()).model_path
    for prompt, a, t in zip(prompts, alone, together, strict=True):
        if a != t:
            assert _tie_at_divergence(stub, model_path, prompt, a, t), (
                f"{prompt!r}: batched text differs from solo text at a non-tie:\n{a!r}\n{t!r}")


def test_one_trace_per_request_across_all_services(otlp, stub):
    receiver, _ = otlp
    rid = f"trace-{uuid.uuid4().hex}"
    _, msgs = collect_text(stub, text_request("trace me", rid=rid, max_new_tokens=4,
                                              ignore_eos=True))
    assert msgs[-1].finished

    def spans_of_request(spans):
        ours = [s for s in spans if s["attributes"].get("meshlm.rid") is not None
                and s["attributes"]["meshlm.rid"].string_value == rid]
        return {s["service"] for s in ours} >= {"meshlm-gateway", "meshlm-tokenizer",
                                                "meshlm-scheduler", "meshlm-detokenizer"}

    assert receiver.wait_for(spans_of_request, timeout=30), "spans from all four services"
    ours = {s["service"]: s for s in receiver.spans
            if s["attributes"].get("meshlm.rid") is not None
            and s["attributes"]["meshlm.rid"].string_value == rid}
    trace_ids = {s["trace_id"] for s in ours.values()}
    assert len(trace_ids) == 1, "one trace per request"
    gw, tok = ours["meshlm-gateway"], ours["meshlm-tokenizer"]
    sch, det = ours["meshlm-scheduler"], ours["meshlm-detokenizer"]
    assert tok["parent"] == gw["span_id"]
    assert sch["parent"] == tok["span_id"]
    assert det["parent"] == sch["span_id"]
    # The gateway's span hangs under the RPC's server span, in the same trace.
    rpc = [s for s in receiver.spans if s["span_id"] == gw["parent"]]
    assert rpc and rpc[0]["name"] == "TextGenerate" and rpc[0]["trace_id"] == gw["trace_id"]


def test_streamed_http_requests_trace_without_errors(otlp, mesh):
    """The gateway's span of an HTTP stream covers the whole stream though the stream's steps
    run in more than one task; no request leaves an error in the gateway's log."""
    import httpx

    receiver, _ = otlp
    log = mesh.log_path("gateway")
    start = log.stat().st_size
    rids = [f"http-trace-{uuid.uuid4().hex}" for _ in range(4)]

    def stream(rid: str) -> int:
        """The stream's completion tokens, from its last chunk (a busy gateway may fold two
        tokens into one chunk, so chunks are not counted)."""
        body = {"text": "trace me", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        with httpx.stream("POST", f"{mesh.addresses.gateway_http}/generate", json=body,
                          timeout=60) as resp:
            chunks = [json.loads(line[len("data: "):]) for line in resp.iter_lines()
                      if line.startswith("data: {")]
        return int(chunks[-1]["meta_info"]["completion_tokens"]) if chunks else 0

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(stream, rids)) == [4] * 4

    def gateway_spans(spans):
        return {s["attributes"]["meshlm.rid"].string_value for s in spans
                if s["service"] == "meshlm-gateway" and s["name"] == "gateway.generate"
                and s["attributes"].get("meshlm.rid") is not None} >= set(rids)

    assert receiver.wait_for(gateway_spans, timeout=30), "a gateway span per stream"
    with log.open() as f:
        f.seek(start)
        errors = [line for line in f if '"level":"error"' in line]
    assert errors == []
