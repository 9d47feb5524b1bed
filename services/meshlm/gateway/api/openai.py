"""The OpenAI-shaped SglangService RPCs, and the one implementation that they and the HTTP
routes (`front/openai_routes.py`) share.

`chat_chunks`, `completion_chunks` and `embedding_response` take a parsed request
(`protocol/openai.py`), turn each prompt into a public Generate/TextGenerate/TextEmbed request
checked by the gateway's own validation, run it through the gateway's generation path
(`GenerationRPCs.generate`: n > 1 fan-out, logprobs, abort when the caller goes away) and fold
the updates into OpenAI's shapes (`protocol/openai_responses.py`). A chat conversation goes
to the tokenizer as its messages, in the request itself: the tokenizer renders it with the
checkpoint's template (the generation prompt, or the final message left open to continue),
encodes it and checks it against the context in the same step as any prompt, and fills in
OpenAI's default max_tokens (the room the context leaves), so a chat costs no round trip before
it is sent (1.2-1.4 ms of TTFT at concurrency 1 when it was `Tokenizer.ApplyChatTemplate`
first); the gateway never renders templates itself.

Streams of OpenAIStreamChunk: not streaming, one chunk holding the whole response; streaming,
one chunk per OpenAI stream chunk. The last chunk has `finished` set. Errors are MeshErrors whose
messages name the fields as the client wrote them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

from meshlm.common.context_length import truncated
from meshlm.common.errors import MeshError, invalid
from meshlm.common.packed import Plain
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore, request_template
from meshlm.gateway.api.direct import ChunkWriter, Express
from meshlm.gateway.api.generation import GenerationRPCs, validated
from meshlm.gateway.api.tokens import TokenRPCs
from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.bounds import text_chars
from meshlm.gateway.protocol.chat_output import json_after_thinking, output_reader, thinking
from meshlm.gateway.protocol.constraints import think_first
from meshlm.gateway.protocol.meta_info import running_meta
from meshlm.gateway.protocol.openai import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_embedding,
    public_request,
    template_request,
)
from meshlm.gateway.protocol.openai_errors import model_not_found, renamed
from meshlm.gateway.protocol.openai_logprobs import dumps
from meshlm.gateway.protocol.openai_responses import (
    Answer,
    ChatAnswer,
    CompletionAnswer,
    embedding_body,
)
from meshlm.gateway.protocol.reasoning import tags
from meshlm.gateway.protocol.validation import (
    Limits,
    ValidatedRequest,
    check_batch,
    check_prompt_chars,
    validate_chat,
    validate_embed,
    validate_generate,
    validate_text_embed,
    validate_text_generate,
)
from sglang.runtime.v1 import sglang_pb2 as pb

R = TypeVar("R")
T = TypeVar("T")
Chunks = AsyncGenerator[pb.OpenAIStreamChunk, None]


class OpenAIRPCs:
    """ChatComplete, Complete, OpenAIEmbed: OpenAI JSON in `json_body`, answered in OpenAI's
    shapes (streamed as OpenAIStreamChunk)."""

    def __init__(self, core: GatewayCore, generation: GenerationRPCs, tokens: TokenRPCs) -> None:
        self.core = core
        self.generation = generation
        self.tokens = tokens

    async def ChatComplete(self, req: pb.OpenAIRequest,
                           ctx: CallContext) -> AsyncIterator[pb.OpenAIStreamChunk]:
        async for chunk in self.chat_chunks(parse_chat(req.json_body)):
            yield chunk

    async def Complete(self, req: pb.OpenAIRequest,
                       ctx: CallContext) -> AsyncIterator[pb.OpenAIStreamChunk]:
        async for chunk in self.completion_chunks(parse_completion(req.json_body)):
            yield chunk

    async def OpenAIEmbed(self, req: pb.OpenAIRequest, ctx: CallContext) -> pb.OpenAIResponse:
        """status_code is the HTTP status of the same request on /v1/embeddings (200: failures
        are the call's gRPC status)."""
        body = await self.embedding_response(parse_embedding(req.json_body))
        return pb.OpenAIResponse(json_body=body, status_code=200)

    # ---- the implementation the HTTP routes share --------------------------------------------

    async def chat_chunks(self, req: ChatRequest, writer: ChunkWriter | None = None) -> Chunks:
        limits = await self.core.limits()
        model = served_model(self.core, req.model)
        check_batch(req.n, limits.max_batch, "n")
        check_prompt_chars(text_chars([req.messages, req.tools]), limits, "messages")
        identity = self.core.identity
        if req.budget_if_read and not identity.reasoning_parser:
            req.thinking_budget = None  # Anthropic's budget_tokens: a target, not a must
        output = output_reader(req, identity.tool_call_parser, identity.reasoning_parser)
        chat = template_request(req.messages, req.add_generation_prompt,
                                req.continue_final_message, req.template_kwargs,
                                req.add_special_tokens, req.tools,
                                request_template(identity, req.chat_template))
        # The prompt: `chat`, rendered by the tokenizer, which also sets the default
        # max_tokens; until then the largest room a prompt can leave stands in for it.
        public = public_request(req, [], max_new_tokens=limits.max_model_len - 1)
        try:  # OpenAI's default max_tokens: whatever room the context leaves (the tokenizer's)
            v = await validated(validate_chat, public.sampling_params, public, chat,
                                not req.sampling.HasField("max_new_tokens"), limits)
        except MeshError as e:
            raise renamed(e, req.names) from None
        v.return_text = True
        starts_in_thought = thinking(req, identity.reasoning_parser)
        if starts_in_thought is not None and json_after_thinking(req):
            v.sampling.grammar = think_first(v.sampling.grammar, starts_in_thought,
                                             tags(identity.reasoning_parser))
        v.return_prompt_ids, v.cache_salt = req.return_token_ids, req.cache_salt
        v.truncate, v.truncate_right = truncation(req, limits), req.truncate_right
        answer = ChatAnswer(model=model, created=int(time.time()), n=v.n, prompts=1,
                            stream=req.stream, include_usage=req.include_usage,
                            continuous_usage=req.continuous_usage,
                            top_logprobs=req.top_logprobs, echo=req.echo_text,
                            output=output,
                            token_ids=req.return_token_ids, tokens_as_ids=req.tokens_as_ids,
                            prompt_logprobs=req.prompt_logprobs,
                            asked_ids=bool(req.logprob_ids))
        async for chunk in self._answer(req, [(v, req.names)], answer, writer):
            yield chunk

    async def completion_chunks(self, req: CompletionRequest,
                                writer: ChunkWriter | None = None) -> Chunks:
        limits = await self.core.limits()
        model = served_model(self.core, req.model)
        check_batch(len(req.prompts) * req.n, limits.max_batch, "prompt")
        cut = truncation(req, limits)
        runs = []
        for i, prompt in enumerate(req.prompts):
            key = f"prompt[{i}]" if req.batch else "prompt"
            names = {**req.names, "text": key, "input_ids": key, "logprob_start_len": key}
            if isinstance(prompt, list):  # cut here too, for the gateway's own checks
                prompt = truncated(prompt, cut, req.truncate_right)
            v = await _validated(public_request(req, prompt), limits, names)
            v.add_special_tokens = req.add_special_tokens
            v.return_prompt_ids, v.cache_salt = req.return_token_ids, req.cache_salt
            v.truncate, v.truncate_right = cut, req.truncate_right
            runs.append((v, names))
        echo = None
        if req.echo:
            echo = await asyncio.gather(*(self._prompt_text(p) for p in req.prompts))
        answer = CompletionAnswer(model=model, created=int(time.time()), n=req.n,
                                  prompts=len(runs), stream=req.stream,
                                  include_usage=req.include_usage,
                                  continuous_usage=req.continuous_usage,
                                  top_logprobs=req.top_logprobs, echo=echo,
                                  token_ids=req.return_token_ids,
                                  tokens_as_ids=req.tokens_as_ids,
                                  prompt_logprobs=req.prompt_logprobs,
                                  asked_ids=bool(req.logprob_ids))
        async for chunk in self._answer(req, runs, answer, writer):
            yield chunk

    async def embedding_response(self, req: EmbeddingRequest) -> bytes:
        limits = await self.core.limits()
        model = served_model(self.core, req.model)
        check_batch(len(req.inputs), limits.max_batch, "input")
        runs = []
        for i, item in enumerate(req.inputs):
            key = f"input[{i}]" if len(req.inputs) > 1 else "input"
            names = {"text": key, "input_ids": key}
            try:
                v = (validate_text_embed(pb.TextEmbedRequest(text=item), limits)
                     if isinstance(item, str)
                     else validate_embed(pb.EmbedRequest(input_ids=item), limits))
            except MeshError as e:
                raise renamed(e, names) from None
            runs.append((v, names))
        results = await all_of([renaming(self.generation.embed(v), names) for v, names in runs])
        vectors = [update.embedding or [] for update, _ in results]
        prompt_tokens = sum(update.prompt_tokens for update, _ in results)
        return dumps(embedding_body(model, vectors, prompt_tokens, base64=req.base64))

    async def _prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text (echo): token ids are decoded without their special tokens (as
        SGLang echoes them)."""
        if isinstance(prompt, str):
            return prompt
        return await self.tokens.text(prompt, skip_special_tokens=True)

    async def _answer(self, req: GenerationRequest,
                      runs: list[tuple[ValidatedRequest, dict[str, str]]],
                      answer: Answer, writer: ChunkWriter | None = None) -> Chunks:
        """Run every prompt through the gateway and fold their updates into `answer`'s
        chunks; with `writer`, a lone streamed sample's running chunks may be written
        directly (`api/direct.py`)."""
        express = (_chunk_express(answer, writer)
                   if writer is not None and req.stream and len(runs) == 1 else None)
        streams = [_renaming_stream(self.generation.generate(v, express), names)
                   for v, names in runs]
        async for prompt, (update, meta) in _merged(streams):
            chunks = answer.add(prompt, update, meta)
            for i, chunk in enumerate(chunks):
                last = answer.done and i == len(chunks) - 1 and not req.include_usage
                yield pb.OpenAIStreamChunk(json_chunk=dumps(chunk), finished=last)
        if not req.stream:
            yield pb.OpenAIStreamChunk(json_chunk=dumps(answer.response()), finished=True)
        elif req.include_usage:
            yield pb.OpenAIStreamChunk(json_chunk=dumps(answer.usage_chunk()), finished=True)


def _chunk_express(answer: Answer, writer: ChunkWriter) -> Express:
    """A running output folded into `answer` and its chunks written, if `writer` can take
    them now (checked before anything is folded in)."""
    def express(item: Plain) -> bool:
        if not writer.writable():
            return False
        rid, ids, prompt, completion, cached, text = item
        update = Update(text, list(ids), None, None, prompt, completion, cached)
        for chunk in answer.add(0, update, running_meta(rid, prompt, completion, cached)):
            writer.write(dumps(chunk))
        return True
    return express


def served_model(core: GatewayCore, model: str | None) -> str:
    """The served model's name; NOT_FOUND for any other."""
    served = core.identity.served_model_name
    if model is not None and model != served:
        raise model_not_found(model, served)
    return served


def truncation(req: GenerationRequest, limits: Limits) -> int:
    """How many prompt ids vLLM's truncate_prompt_tokens keeps (0: no cut; -1: the context
    length); more than the context length is refused."""
    keep = req.truncate
    if keep is None:
        return 0
    if keep > limits.max_model_len:
        raise invalid("truncate_prompt_tokens", f"must be at most max_model_len "
                                                f"({limits.max_model_len}), got {keep}")
    return limits.max_model_len if keep == -1 else keep


async def _validated(public: pb.TextGenerateRequest | pb.GenerateRequest, limits: Limits,
                     names: dict[str, str]) -> ValidatedRequest:
    """The gateway's validation of one prompt's public request; always answering with text."""
    check = (validate_text_generate if isinstance(public, pb.TextGenerateRequest)
             else validate_generate)
    try:
        v = await validated(check, public.sampling_params, public, limits)
    except MeshError as e:
        raise renamed(e, names) from None
    v.return_text = True
    return v


# ---- streams ---------------------------------------------------------------------------------


async def renaming(call: Awaitable[R], names: dict[str, str]) -> R:
    try:
        return await call
    except MeshError as e:
        raise renamed(e, names) from None


async def _renaming_stream(stream: AsyncIterator[T], names: dict[str, str]) -> AsyncIterator[T]:
    """`stream` with its failure in the client's field names (e.g. the tokenizer's context
    check); closing this closes `stream`, which ends its request in the mesh."""
    try:
        async for item in stream:
            yield item
    except MeshError as e:
        raise renamed(e, names) from None
    finally:
        await _close(stream)


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def _merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's position. The first
    failure ends it; ending it early (or failing) cancels the other streams, which aborts
    their requests."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue[tuple[int, T] | Exception | None] = asyncio.Queue(len(streams))

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item))
        except Exception as e:
            await queue.put(e)
        else:
            await queue.put(None)
        finally:
            await _close(stream)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, Exception):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def all_of(calls: list[Coroutine[Any, Any, R]]) -> list[R]:
    """Every call's result, run concurrently; the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
