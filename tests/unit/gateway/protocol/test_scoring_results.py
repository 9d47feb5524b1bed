"""The pure folding of engine answers into scores, rankings and class labels."""

from __future__ import annotations

import math

import pytest

from meshlm.gateway.protocol.scoring_results import (
    classify_data,
    cross_encoder_score,
    label_logprobs,
    label_scores,
    ranked,
    softmax,
    yes_probability,
)
from meshlm.v1 import common_pb2


def test_label_scores_full_vocabulary_or_renormalised() -> None:
    lps = [math.log(0.2), math.log(0.05)]
    assert label_scores(lps, False) == pytest.approx([0.2, 0.05])
    assert label_scores(lps, True) == pytest.approx([0.8, 0.2])
    assert softmax([1000.0, 1000.0]) == [0.5, 0.5]  # no overflow


def test_label_logprobs_in_the_asked_order() -> None:
    msg = common_pb2.Logprobs(output_token_ids_logprobs=[
        common_pb2.TopLogprobs(token_ids=[9, 4, 9], logprobs=[-1.0, -2.0, -1.0])])
    assert label_logprobs(msg, [4, 9, 9]) == [-2.0, -1.0, -1.0]
    with pytest.raises(ValueError):
        label_logprobs(common_pb2.Logprobs(), [4])


def test_yes_probability_and_cross_encoder_scores() -> None:
    assert yes_probability(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert yes_probability(-1000.0, 0.0) == pytest.approx(0.0)
    assert cross_encoder_score([0.0]) == 0.5  # one label: sigmoid
    assert cross_encoder_score([2.0]) == pytest.approx(1 / (1 + math.exp(-2)))
    assert cross_encoder_score([0.0, math.log(3.0)]) == pytest.approx(0.75)  # last label


def test_ranked_best_first_ties_in_input_order_top_n() -> None:
    docs = ["a", "b", "c", "d"]
    out = ranked([0.1, 0.9, 0.5, 0.9], docs, top_n=None, return_documents=True)
    assert [r["index"] for r in out] == [1, 3, 2, 0]
    assert out[0] == {"score": 0.9, "index": 1, "document": "b"}
    out = ranked([0.1, 0.9, 0.5, 0.9], docs, top_n=2, return_documents=False)
    assert out == [{"score": 0.9, "index": 1}, {"score": 0.9, "index": 3}]
    assert len(ranked([0.1], ["a"], top_n=10, return_documents=True)) == 1


def test_classify_data_labels() -> None:
    [first, second] = classify_data([[0.0, 2.0], [1.0, -1.0, 3.0]], {"0": "neg", "1": "pos"})
    assert first["label"] == "pos" and first["num_classes"] == 2 and first["index"] == 0
    assert first["probs"] == pytest.approx(softmax([0.0, 2.0]))
    assert second["label"] == "LABEL_2" and second["index"] == 1
