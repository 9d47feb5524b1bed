"""Tokenize and Detokenize: passed through to a tokenizer, checked against the model first."""

from __future__ import annotations

from typing import Any

from meshlm.common import deadline
from meshlm.common.rpc import CallContext
from meshlm.gateway.api.core import GatewayCore, request_template
from meshlm.gateway.protocol.bounds import text_chars
from meshlm.gateway.protocol.openai import template_request
from meshlm.gateway.protocol.validation import (
    check_prompt_chars,
    validate_detokenize,
    validate_tokenize,
)
from meshlm.v1 import tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb


class TokenRPCs:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Tokenize(self, req: pb.TokenizeRequest, ctx: CallContext) -> pb.TokenizeResponse:
        model = await self.core.model_info()
        validate_tokenize(req, self.core.limits_of(model))
        add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
        reply = await self._tokenize(req.text, add_special)
        return pb.TokenizeResponse(tokens=reply.tokens, count=len(reply.tokens),
                                   max_model_len=model.max_model_len, input_text=req.text)

    async def Detokenize(self, req: pb.DetokenizeRequest, ctx: CallContext,
                         skip_special_tokens: bool = False) -> pb.DetokenizeResponse:
        """The tokens' text; special tokens are kept unless asked (SGLang's /detokenize)."""
        validate_detokenize(req, await self.core.limits())
        return pb.DetokenizeResponse(text=await self.text(list(req.tokens), skip_special_tokens))

    async def text(self, tokens: list[int], skip_special_tokens: bool) -> str:
        """The tokens' text, by a tokenizer (no checks: for ids the gateway already checked)."""
        reply = await self.core.call(self.core.tokenizer().Detokenize(
            tokenizer_pb2.DetokenizeRequest(tokens=tokens,
                                            skip_special_tokens=skip_special_tokens),
            timeout=deadline.timeout()))
        return str(reply.text)

    async def token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The text's token ids, by a tokenizer."""
        return list((await self._tokenize(text, add_special_tokens)).tokens)

    async def chat_tokens(self, messages: list[Any], add_generation_prompt: bool,
                          continue_final_message: bool = False,
                          template_kwargs: dict[str, Any] | None = None,
                          add_special_tokens: bool = False,
                          tools: list[dict[str, Any]] | None = None,
                          chat_template: str = "") -> list[int]:
        """A conversation rendered by the checkpoint's chat template (with the generation
        prompt, or the final message left open to continue) and encoded, by a tokenizer; its
        text is checked against the prompt bound before it is sent."""
        check_prompt_chars(text_chars([messages, tools]), await self.core.limits(), "messages")
        reply = await self.core.call(self.core.tokenizer().ApplyChatTemplate(
            template_request(messages, add_generation_prompt, continue_final_message,
                             template_kwargs, add_special_tokens, tools,
                             request_template(self.core.identity, chat_template)),
            timeout=deadline.timeout()))
        return list(reply.tokens)

    async def _tokenize(self, text: str,
                        add_special_tokens: bool) -> tokenizer_pb2.TokenizeResponse:
        return await self.core.call(self.core.tokenizer().Tokenize(
            tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
            timeout=deadline.timeout()))
