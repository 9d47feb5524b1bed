"""Classify, OpenAIClassify, Score and Rerank, and the implementation they share with the HTTP
routes /v1/classify, /v1/score and /v1/rerank (`front/openai_routes.py`).

Every item is its own request on the gateway's one path (`GenerationRPCs.generate`), all sent at
once: they reach the scheduler together and run in the same engine steps (and, sharing the
query's prefix, usually on the same scheduler and its prefix cache).

- Score: each item's prompt (query + item, or item + query with item_first; text or token ids)
  runs with max_new_tokens 1, greedy, asking the engine for the label tokens' logprobs at the
  next-token position (token_ids_logprob); see `protocol/scoring_results.py` for the scores.
- Rerank, generative checkpoint (meshlm's choice): each document in RERANK_PROMPT, scored as
  P(yes) / (P(yes) + P(no)) of the first tokens of " yes" and " no" by the checkpoint's
  tokenizer, or of the extension field label_token_ids [yes, no]. Sequence-classification
  checkpoint: the (query, document) pair, encoded with the tokenizer's pair template, through
  the classification head (a cross-encoder).
- Classify / OpenAIClassify: an embedding request on a `*ForSequenceClassification` checkpoint,
  whose pooled output is its class logits (Classify returns them unnormalised; OpenAIClassify
  their softmax and id2label's label). Any other checkpoint: FAILED_PRECONDITION.

The OpenAI-shaped RPCs answer with status_code 200: their failures are the call's gRPC status.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any

import grpc

from meshlm.common.errors import MeshError, invalid
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore
from meshlm.gateway.api.generation import GenerationRPCs
from meshlm.gateway.api.openai import all_of, renaming, served_model
from meshlm.gateway.api.tokens import TokenRPCs
from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.openai_errors import renamed
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.scoring import (
    ClassifyRequest,
    RerankRequest,
    ScoreRequest,
    parse_classify,
    parse_rerank,
    parse_score,
)
from meshlm.gateway.protocol.scoring_results import (
    classify_data,
    cross_encoder_score,
    label_logprobs,
    label_scores,
    ranked,
    yes_probability,
)
from meshlm.gateway.protocol.validation import (
    Limits,
    ValidatedRequest,
    check_batch,
    check_prompt_chars,
    check_prompt_length,
    check_token_ids,
    validate_classify,
    validate_text_embed,
)
from meshlm.v1 import common_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

CLASSIFIER_SUFFIX = "ForSequenceClassification"
RERANK_PROMPT = ("Query: {query}\nDocument: {document}\n"
                 "Is the document relevant to the query? Answer yes or no.\nAnswer:")
RERANK_WORDS = (" yes", " no")


class ScoringRPCs:
    """Classify (SGLang-native), OpenAIClassify, Score, Rerank (OpenAI JSON in json_body)."""

    def __init__(self, core: GatewayCore, generation: GenerationRPCs, tokens: TokenRPCs) -> None:
        self.core = core
        self.generation = generation
        self.tokens = tokens

    async def Classify(self, req: pb.ClassifyRequest, ctx: CallContext) -> pb.ClassifyResponse:
        v = validate_classify(req, await self.core.limits())
        _require_classifier(self.core, "Classify")
        update, meta = await self.generation.embed(v)
        return pb.ClassifyResponse(embedding=update.embedding or [], meta_info=meta)

    async def OpenAIClassify(self, req: pb.OpenAIRequest, ctx: CallContext) -> pb.OpenAIResponse:
        body = await self.classify_response(parse_classify(req.json_body))
        return pb.OpenAIResponse(json_body=body, status_code=200)

    async def Score(self, req: pb.OpenAIRequest, ctx: CallContext) -> pb.OpenAIResponse:
        body = await self.score_response(parse_score(req.json_body))
        return pb.OpenAIResponse(json_body=body, status_code=200)

    async def Rerank(self, req: pb.OpenAIRequest, ctx: CallContext) -> pb.OpenAIResponse:
        body = await self.rerank_response(parse_rerank(req.json_body))
        return pb.OpenAIResponse(json_body=body, status_code=200)

    # ---- the implementation the HTTP routes share --------------------------------------------

    async def score_response(self, req: ScoreRequest) -> bytes:
        limits = await self.core.limits()
        model = served_model(self.core, req.model)
        labels = req.label_token_ids
        check_token_ids(labels, limits, "label_token_ids")
        check_batch(len(req.items), limits.max_batch, "items")
        for i, item in enumerate(req.items):  # sizes first, before any query + item is built
            if isinstance(item, list):
                check_prompt_length(len(req.query) + len(item), 1, limits,
                                    field_path=f"items[{i}]")
            else:
                check_prompt_chars(len(req.query) + len(item), limits, f"items[{i}]")
        if isinstance(req.query, list) and req.query:
            check_token_ids(req.query, limits, "query")
        runs = []
        for i in range(len(req.items)):
            key = f"items[{i}]"
            item = req.items[i]
            if isinstance(item, list):
                check_token_ids(item, limits, key)
            runs.append((_label_request(req.prompt(i), labels, limits, key),
                         {"text": key, "input_ids": key}))
        results = await all_of([renaming(self._final(v), names) for v, names in runs])
        scores = [label_scores(label_logprobs(u.logprobs, labels), req.apply_softmax)
                  for u in results]
        prompt_tokens = sum(u.prompt_tokens for u in results)
        return dumps({"scores": scores, "model": model, "usage": _usage(prompt_tokens),
                      "object": "scoring"})

    async def rerank_response(self, req: RerankRequest) -> bytes:
        limits = await self.core.limits()
        served_model(self.core, req.model)
        check_batch(len(req.documents), limits.max_batch, "documents")
        for i, doc in enumerate(req.documents):  # before any prompt is built with the query
            check_prompt_chars(len(req.query) + len(doc), limits, f"documents[{i}]")
        if _architecture(self.core).endswith(CLASSIFIER_SUFFIX):
            if req.label_token_ids is not None:
                raise invalid("label_token_ids", "is for generative checkpoints; this one is a "
                                                 "sequence classifier")
            pairs = [_pair_request(req.query, doc) for doc in req.documents]
            embedded = await all_of([renaming(self.generation.embed(v), _doc(i))
                                     for i, v in enumerate(pairs)])
            scores = [cross_encoder_score(u.embedding or [0.0]) for u, _ in embedded]
        else:
            labels = req.label_token_ids or await self._yes_no()
            check_token_ids(labels, limits, "label_token_ids")
            prompts = [RERANK_PROMPT.format(query=req.query, document=doc)
                       for doc in req.documents]
            runs = [_label_request(p, labels, limits, f"documents[{i}]")
                    for i, p in enumerate(prompts)]
            results = await all_of([renaming(self._final(v), _doc(i))
                                    for i, v in enumerate(runs)])
            scores = [yes_probability(*label_logprobs(u.logprobs, labels)) for u in results]
        return dumps(ranked(scores, req.documents, top_n=req.top_n,
                            return_documents=req.return_documents))

    async def classify_response(self, req: ClassifyRequest) -> bytes:
        limits = await self.core.limits()
        model = served_model(self.core, req.model)
        _require_classifier(self.core, "classify")
        check_batch(len(req.inputs), limits.max_batch, "input")
        runs = []
        for i, item in enumerate(req.inputs):
            key = f"input[{i}]" if req.batch else "input"
            names = {"text": key, "input_ids": key}
            public = (pb.ClassifyRequest(text=item) if isinstance(item, str)
                      else pb.ClassifyRequest(input_ids=item))
            if req.rid is not None:
                public.rid = req.rid
            try:
                runs.append((validate_classify(public, limits), names))
            except MeshError as e:
                raise renamed(e, names) from None
        results = await all_of([renaming(self.generation.embed(v), names) for v, names in runs])
        config = _config(self.core)
        data = classify_data([u.embedding or [] for u, _ in results],
                             config.get("id2label") or {})
        prompt_tokens = sum(u.prompt_tokens for u, _ in results)
        rid = req.rid or uuid.uuid4().hex
        return dumps({"id": f"classify-{rid}", "object": "list", "created": int(time.time()),
                      "model": model, "data": data, "usage": _usage(prompt_tokens)})

    async def _final(self, v: ValidatedRequest) -> Update:
        """Run a one-output request to its final update (merged: logprobs included)."""
        async with aclosing(self.generation.generate(v)) as stream:
            async for update, _ in stream:
                if update.final is not None:
                    return update
        raise MeshError(grpc.StatusCode.INTERNAL, "the scoring request ended without a result")

    async def _yes_no(self) -> list[int]:
        """The first token of " yes" and of " no" by the checkpoint's tokenizer."""
        ids = []
        for word in RERANK_WORDS:
            tokens = await self.tokens.token_ids(word, add_special_tokens=False)
            ids.append(tokens[0] if tokens else -1)
        if ids[0] < 0 or ids[0] == ids[1]:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION,
                            "label_token_ids: this tokenizer does not tell \" yes\" from \" no\" "
                            "by their first token; give label_token_ids [yes, no]")
        return ids


# ---- helpers ---------------------------------------------------------------------------------


def _label_request(prompt: str | list[int], labels: list[int], limits: Limits,
                   key: str) -> ValidatedRequest:
    """One greedy token after `prompt`, with the label tokens' logprobs at its position. A
    text prompt's length is checked by the tokenizer; token ids here."""
    if isinstance(prompt, list):
        check_prompt_length(len(prompt), 1, limits, field_path=key)
    sampling = common_pb2.SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_new_tokens=1,
        ignore_eos=True, skip_special_tokens=True, return_logprob=True, logprob_start_len=-1,
        token_ids_logprob=labels)
    return ValidatedRequest(
        rid=None, text=prompt if isinstance(prompt, str) else None,
        input_ids=prompt if isinstance(prompt, list) else None, sampling=sampling,
        stream=False, return_text=False, routing_key=None)


def _pair_request(query: str, document: str) -> ValidatedRequest:
    v = validate_text_embed(pb.TextEmbedRequest(text=query))
    v.text_pair = document
    return v


def _doc(i: int) -> dict[str, str]:
    key = f"documents[{i}]"
    return {"text": key, "input_ids": key}


def _config(core: GatewayCore) -> dict[str, Any]:
    """The checkpoint's config.json, as the tokenizer reported it."""
    if core.model is None or not core.model.json_info:
        return {}
    config = json.loads(core.model.json_info).get("config")
    return config if isinstance(config, dict) else {}


def _architecture(core: GatewayCore) -> str:
    architectures = _config(core).get("architectures") or ["LlamaForCausalLM"]
    return str(architectures[0])


def _require_classifier(core: GatewayCore, what: str) -> None:
    arch = _architecture(core)
    if not arch.endswith(CLASSIFIER_SUFFIX):
        raise MeshError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"{what} needs a sequence-classification checkpoint (config.json "
                        f"architectures *{CLASSIFIER_SUFFIX}); this model is {arch}")


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
            "total_tokens": prompt_tokens, "prompt_tokens_details": None}
