"""Scores, rankings and class labels from what the engine returned. Pure: no I/O.

Score (SGLang's /v1/score): each label token's probability at the position after the prompt;
`apply_softmax` renormalises over the label tokens (a softmax of their logprobs), else each is
its probability over the whole vocabulary (exp of its logprob).

Rerank, generative checkpoint: P(yes) / (P(yes) + P(no)) of the label tokens; a
sequence-classification checkpoint (cross-encoder): one label, sigmoid of its logit (as
sentence-transformers' CrossEncoder); two or more, the softmax probability of the last label
(the "relevant" class by convention). Results best first (ties in input order), top_n of them.

Classify: softmax over the class logits, and the label of the most likely class from
config.json's id2label (LABEL_<i> where it names none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from meshlm.v1 import common_pb2


def softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def label_logprobs(logprobs: common_pb2.Logprobs | None, labels: Sequence[int]) -> list[float]:
    """The logprobs of `labels` at the first output position (token_ids_logprob)."""
    if logprobs is None or not logprobs.output_token_ids_logprobs:
        raise ValueError("the engine returned no label logprobs")
    first = logprobs.output_token_ids_logprobs[0]
    by_id = dict(zip(first.token_ids, first.logprobs, strict=True))
    return [by_id[t] for t in labels]


def label_scores(logprobs: Sequence[float], apply_softmax: bool) -> list[float]:
    if apply_softmax:
        return softmax(logprobs)
    return [math.exp(x) for x in logprobs]


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def yes_probability(yes_logprob: float, no_logprob: float) -> float:
    """P(yes) / (P(yes) + P(no)) = sigmoid(logprob(yes) - logprob(no))."""
    return sigmoid(yes_logprob - no_logprob)


def cross_encoder_score(logits: Sequence[float]) -> float:
    if len(logits) == 1:
        return sigmoid(logits[0])
    return softmax(logits)[-1]


def ranked(scores: Sequence[float], documents: Sequence[str], *, top_n: int | None,
           return_documents: bool) -> list[dict[str, Any]]:
    """SGLang's rerank reply: [{"score", "document"?, "index"}], best first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    out = []
    for i in order[:top_n]:
        entry: dict[str, Any] = {"score": scores[i], "index": i}
        if return_documents:
            entry["document"] = documents[i]
        out.append(entry)
    return out


def classify_data(logits: Sequence[Sequence[float]],
                  id2label: Mapping[str, str]) -> list[dict[str, Any]]:
    """One {"index", "label", "probs", "num_classes"} per input."""
    data = []
    for i, row in enumerate(logits):
        probs = softmax(row)
        best = max(range(len(row)), key=lambda k: row[k])
        data.append({"index": i, "label": id2label.get(str(best), f"LABEL_{best}"),
                     "probs": probs, "num_classes": len(probs)})
    return data
