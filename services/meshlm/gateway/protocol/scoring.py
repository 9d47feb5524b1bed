"""Request bodies of SGLang's /v1/score, /v1/rerank and /v1/classify -> what the gateway runs.
Pure: no I/O. Errors are INVALID_ARGUMENT naming the field as the client wrote it; token ids
are checked against the vocabulary later, where the gateway knows it (`api/scoring.py`).

    /v1/score     {query?, items, label_token_ids, apply_softmax?, item_first?, model?}
                  query and items both text (a string, or a string and a list of strings) or
                  both token ids (a list of ids and a list of id lists)
    /v1/rerank    {query, documents, top_n?, return_documents? (default true), model?}
                  meshlm extension: label_token_ids [yes_id, no_id] for a generative checkpoint
    /v1/classify  {input, model?, rid?}: a string, strings, token ids or lists of token ids
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshlm.common.errors import invalid
from meshlm.gateway.protocol.openai import JsonBody, Prompt, checked_ids, is_ids, is_int, prompts_of

MAX_ITEMS = 256   # items of one score request, documents of one rerank request
MAX_LABELS = 128  # label_token_ids of one score request
_INT32 = 2**31 - 1


@dataclass
class ScoreRequest:
    model: str | None
    query: Prompt  # "" or [] when the client gave none
    items: list[Prompt]
    label_token_ids: list[int]
    apply_softmax: bool
    item_first: bool

    def prompt(self, i: int) -> Prompt:
        """Item i's prompt: query + item, or item + query when item_first (text or ids)."""
        item = self.items[i]
        if isinstance(item, str):
            assert isinstance(self.query, str)
            return item + self.query if self.item_first else self.query + item
        assert isinstance(self.query, list)
        return item + self.query if self.item_first else self.query + item


@dataclass
class RerankRequest:
    model: str | None
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool
    label_token_ids: list[int] | None  # [yes, no] for a generative checkpoint


@dataclass
class ClassifyRequest:
    model: str | None
    inputs: list[Prompt]
    batch: bool  # input was a list of inputs
    rid: str | None


def parse_score(body: bytes) -> ScoreRequest:
    b = JsonBody(body)
    model = b.string("model")
    items = _items(b.get("items"))
    query = _query(b.get("query"), text=isinstance(items[0], str))
    labels = b.get("label_token_ids")
    if labels is None:
        raise invalid("label_token_ids", "is required: the token ids to score")
    labels = _label_ids(labels, "label_token_ids", MAX_LABELS)
    apply_softmax = bool(b.boolean("apply_softmax"))
    item_first = bool(b.boolean("item_first"))
    for key in ("embed_override_token_id", "query_embed_overrides", "item_embed_overrides"):
        b.unsupported(key, " (no embedding overrides)")
    b.unsupported("return_pooled_hidden_states", "", (False,))
    b.check_unknown()
    req = ScoreRequest(model=model, query=query, items=items, label_token_ids=labels,
                       apply_softmax=apply_softmax, item_first=item_first)
    for i, item in enumerate(items):  # not query + item: that is built later, within bounds
        if not query and not item:
            raise invalid(f"items[{i}]", "query + item is empty")
    return req


def _items(value: Any) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid("items", "must be a string, a list of strings or a list of token id "
                               "lists, and not empty")
    if len(value) > MAX_ITEMS:
        raise invalid("items", f"at most {MAX_ITEMS} items in one request, got {len(value)}")
    text = isinstance(value[0], str)
    items: list[Prompt] = []
    for i, item in enumerate(value):
        if text and isinstance(item, str):
            items.append(item)
        elif not text and is_ids(item, f"items[{i}]"):
            items.append(checked_ids(item, f"items[{i}]"))
        else:
            kind = "a string" if text else "a list of token ids"
            raise invalid(f"items[{i}]", f"must be {kind}, as items[0] is")
    return items


def _query(value: Any, *, text: bool) -> Prompt:
    """The query, of the items' kind (text or token ids); none is the empty prompt."""
    if value is None:
        return "" if text else []
    if text and isinstance(value, str):
        return value
    if not text and is_ids(value, "query"):
        return checked_ids(value, "query")
    kind = "a string, as the items are text" if text else "a list of token ids, as the items are"
    raise invalid("query", f"must be {kind}")


def _label_ids(value: Any, key: str, most: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise invalid(key, "must be a non-empty list of token ids")
    if len(value) > most:
        raise invalid(key, f"at most {most} token ids, got {len(value)}")
    for i, t in enumerate(value):
        if not is_int(t) or not 0 <= t <= _INT32:
            raise invalid(f"{key}[{i}]", f"must be a token id, got {t!r}")
    return list(value)


def parse_rerank(body: bytes) -> RerankRequest:
    b = JsonBody(body)
    model = b.string("model")
    query = b.get("query")
    if not isinstance(query, str) or not query.strip():
        raise invalid("query", "must be a non-empty string")
    documents = b.get("documents")
    if not isinstance(documents, list) or not documents:
        raise invalid("documents", "must be a non-empty list of strings")
    if len(documents) > MAX_ITEMS:
        raise invalid("documents", f"at most {MAX_ITEMS} documents in one request, "
                                   f"got {len(documents)}")
    for i, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc.strip():
            raise invalid(f"documents[{i}]", "must be a non-empty string")
    top_n = b.integer("top_n", 1, _INT32)
    return_documents = b.boolean("return_documents")
    labels = b.get("label_token_ids")
    if labels is not None:
        labels = _label_ids(labels, "label_token_ids", 2)
        if len(labels) != 2:
            raise invalid("label_token_ids", "must be two token ids: [yes, no]")
    b.unsupported("instruct")
    b.check_unknown()
    return RerankRequest(model=model, query=query, documents=list(documents), top_n=top_n,
                         return_documents=True if return_documents is None else return_documents,
                         label_token_ids=labels)


def parse_classify(body: bytes) -> ClassifyRequest:
    b = JsonBody(body)
    model = b.string("model")
    inputs, batch = prompts_of(b.get("input"), "input")
    for i, item in enumerate(inputs):
        if isinstance(item, str) and not item.strip():
            raise invalid(f"input[{i}]" if batch else "input", "must not be empty")
    rid = b.string("rid")
    if rid is not None and batch:
        raise invalid("rid", "give a rid only with a single input")
    b.unsupported("priority", " (requests are served in arrival order)", (0,))
    b.check_unknown()
    return ClassifyRequest(model=model, inputs=inputs, batch=batch, rid=rid)
