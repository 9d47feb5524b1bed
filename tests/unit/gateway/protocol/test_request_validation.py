"""Every validation rule, and that each error names the field it is about."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.validation import (
    MAX_N,
    Limits,
    check_prompt_length,
    normalize_sampling,
    validate_detokenize,
    validate_embed,
    validate_generate,
    validate_text_embed,
    validate_text_generate,
    validate_tokenize,
)
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=256, vocab_size=100)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


def _error(fn: Any, *args: Any) -> MeshError:
    with pytest.raises(MeshError) as info:
        fn(*args)
    return info.value


def test_defaults_fill_every_field() -> None:
    s = normalize_sampling(None)
    assert s.temperature == 1.0 and s.top_p == 1.0 and s.top_k == -1 and s.min_p == 0.0
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)
    assert s.max_new_tokens == 128 and s.min_new_tokens == 0
    assert s.skip_special_tokens is True and s.ignore_eos is False
    assert list(s.stop) == [] and list(s.stop_token_ids) == []


def test_given_values_are_kept() -> None:
    s = normalize_sampling(
        pb.SamplingParams(
            temperature=0.0,
            top_p=0.5,
            top_k=40,
            min_p=0.1,
            frequency_penalty=-2,
            presence_penalty=2,
            repetition_penalty=1.2,
            max_new_tokens=7,
            min_new_tokens=7,
            stop=["\n"],
            stop_token_ids=[0, 5],
            ignore_eos=True,
            n=1,
            skip_special_tokens=False,
        )
    )
    assert s.temperature == 0.0 and s.top_k == 40 and s.max_new_tokens == 7
    assert s.min_new_tokens == 7 and list(s.stop) == ["\n"] and list(s.stop_token_ids) == [0, 5]
    assert s.ignore_eos and not s.skip_special_tokens
    assert math.isclose(s.top_p, 0.5) and math.isclose(s.repetition_penalty, 1.2, rel_tol=1e-6)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_mean_off(top_k: int) -> None:
    assert normalize_sampling(pb.SamplingParams(top_k=top_k)).top_k == -1


BAD_SAMPLING: list[tuple[dict[str, Any], str, grpc.StatusCode]] = [
    ({"temperature": -0.1}, "temperature", INVALID),
    ({"temperature": math.inf}, "temperature", INVALID),
    ({"temperature": math.nan}, "temperature", INVALID),
    ({"top_p": 0.0}, "top_p", INVALID),
    ({"top_p": 1.5}, "top_p", INVALID),
    ({"top_p": math.nan}, "top_p", INVALID),
    ({"top_k": -2}, "top_k", INVALID),
    ({"min_p": -0.1}, "min_p", INVALID),
    ({"min_p": 1.1}, "min_p", INVALID),
    ({"frequency_penalty": 2.5}, "frequency_penalty", INVALID),
    ({"frequency_penalty": -2.5}, "frequency_penalty", INVALID),
    ({"presence_penalty": 3}, "presence_penalty", INVALID),
    ({"repetition_penalty": 0}, "repetition_penalty", INVALID),
    ({"repetition_penalty": 2.5}, "repetition_penalty", INVALID),
    ({"min_new_tokens": 1, "max_new_tokens": 0}, "min_new_tokens", INVALID),
    ({"max_new_tokens": -5}, "max_new_tokens", INVALID),
    ({"min_new_tokens": -1}, "min_new_tokens", INVALID),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens", INVALID),
    ({"min_new_tokens": 200}, "min_new_tokens", INVALID),  # default max_new_tokens is 128
    ({"stop": [""]}, "stop[0]", INVALID),
    ({"stop": ["a", "x" * 257]}, "stop[1]", INVALID),
    ({"stop": ["s"] * 17}, "stop", INVALID),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]", INVALID),
    ({"n": MAX_N + 1}, "n", INVALID),
    ({"n": 0}, "n", INVALID),
    ({"n": -1}, "n", INVALID),
    ({"json_schema": "{\"type\": 3}"}, "json_schema", INVALID),
    ({"regex": "a("}, "regex", INVALID),
    ({"json_schema": "{}", "regex": "a+"}, "regex", INVALID),
    ({"logit_bias": {5: 100.5}}, "logit_bias", INVALID),
    ({"logit_bias": {5: float("nan")}}, "logit_bias", INVALID),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", INVALID),
    ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "logit_bias", INVALID),
    ({"allowed_token_ids": [1] * (2**18 + 1)}, "allowed_token_ids", INVALID),
]


@pytest.mark.parametrize(("fields", "name", "code"), BAD_SAMPLING)
def test_bad_sampling_names_the_field(
    fields: dict[str, Any], name: str, code: grpc.StatusCode
) -> None:
    err = _error(normalize_sampling, pb.SamplingParams(**fields))
    assert err.code == code
    assert err.message.startswith(f"sampling_params.{name}: "), err.message


def test_boundaries_are_accepted() -> None:
    normalize_sampling(
        pb.SamplingParams(
            top_p=1.0,
            min_p=1.0,
            frequency_penalty=2,
            presence_penalty=-2,
            repetition_penalty=2,
            max_new_tokens=1,
            min_new_tokens=1,
            stop=["x" * 256] + ["s"] * 15,
            n=1,
        )
    )


def test_message_shows_the_value() -> None:
    err = _error(normalize_sampling, pb.SamplingParams(top_p=1.5))
    assert err.message == "sampling_params.top_p: must be in (0, 1], got 1.5"


def test_field_prefix() -> None:
    err = _error(lambda: normalize_sampling(pb.SamplingParams(top_k=-3), field_prefix="x.sp"))
    assert err.message.startswith("x.sp.top_k: ")


# ---- TextGenerate / Generate -----------------------------------------------------------------


def test_text_generate_ok() -> None:
    v = validate_text_generate(
        pb.TextGenerateRequest(
            text="  ",
            rid="a.B:1-_",
            stream=True,
            routing_key="user-1",
            trace_headers={"traceparent": "00-x"},
            routed_dp_rank=0,
            sampling_params=pb.SamplingParams(max_new_tokens=5),
        ),
        LIMITS,
    )
    assert v.text == "  " and v.input_ids is None and v.return_text and v.stream
    assert v.rid == "a.B:1-_" and v.routing_key == "user-1"
    assert v.trace_headers == {"traceparent": "00-x"} and v.sampling.max_new_tokens == 5


def test_generate_ok() -> None:
    v = validate_generate(pb.GenerateRequest(input_ids=[0, 99]), LIMITS)
    assert v.input_ids == [0, 99] and v.text is None and not v.return_text and not v.stream
    assert v.rid is None and v.routing_key is None and v.trace_headers == {}


def test_sglang_explicit_defaults_are_accepted() -> None:
    validate_generate(
        pb.GenerateRequest(
            input_ids=[1],
            return_logprob=False,
            top_logprobs_num=0,
            logprob_start_len=-1,
            lora_path="",
        ),
        LIMITS,
    )


BAD_REQUESTS: list[tuple[Any, str, grpc.StatusCode]] = [
    (pb.TextGenerateRequest(text=""), "text", INVALID),
    (pb.GenerateRequest(), "input_ids", INVALID),
    (pb.GenerateRequest(input_ids=[1, 100]), "input_ids[1]", INVALID),
    (pb.GenerateRequest(input_ids=[-1]), "input_ids[0]", INVALID),
    (pb.GenerateRequest(input_ids=[1] * 256), "input_ids", INVALID),
    (
        pb.GenerateRequest(
            input_ids=[1] * 200, sampling_params=pb.SamplingParams(max_new_tokens=57)
        ),
        "sampling_params.max_new_tokens",
        INVALID,
    ),
    (pb.GenerateRequest(input_ids=[1], rid=""), "rid", INVALID),
    (pb.GenerateRequest(input_ids=[1], rid="x" * 129), "rid", INVALID),
    (pb.GenerateRequest(input_ids=[1], rid="a b"), "rid", INVALID),
    (pb.GenerateRequest(input_ids=[1], rid="a/b"), "rid", INVALID),
    (pb.TextGenerateRequest(text="a", return_logprob=True, top_logprobs_num=21),
     "top_logprobs_num", INVALID),
    (pb.TextGenerateRequest(text="a", top_logprobs_num=-1), "top_logprobs_num", INVALID),
    (pb.TextGenerateRequest(text="a", logprob_start_len=-2), "logprob_start_len", INVALID),
    (pb.GenerateRequest(input_ids=[1, 2], return_logprob=True, logprob_start_len=2),
     "logprob_start_len", INVALID),
    (pb.TextGenerateRequest(text="a", lora_path="x"), "lora_path", UNIMPLEMENTED),
    (
        pb.GenerateRequest(input_ids=[1], disaggregated_params=pb.DisaggregatedParams()),
        "disaggregated_params",
        UNIMPLEMENTED,
    ),
    (pb.GenerateRequest(input_ids=[1], routed_dp_rank=-1), "routed_dp_rank", INVALID),
    (
        pb.TextGenerateRequest(text="a", sampling_params=pb.SamplingParams(top_p=2)),
        "sampling_params.top_p",
        INVALID,
    ),
    (
        pb.TextGenerateRequest(text="a", sampling_params=pb.SamplingParams(stop_token_ids=[100])),
        "sampling_params.stop_token_ids[0]",
        INVALID,
    ),
    (
        pb.GenerateRequest(input_ids=[1], sampling_params=pb.SamplingParams(n=17)),
        "sampling_params.n",
        INVALID,
    ),
    (
        pb.GenerateRequest(input_ids=[1], sampling_params=pb.SamplingParams(logit_bias={100: 1})),
        "sampling_params.logit_bias",
        INVALID,
    ),
]


def test_logit_bias_reaches_the_internal_params() -> None:
    v = validate_generate(pb.GenerateRequest(input_ids=[1], sampling_params=pb.SamplingParams(
        logit_bias={99: -100, 3: 2.5})), LIMITS)
    assert dict(v.sampling.logit_bias) == {99: -100.0, 3: 2.5}


@pytest.mark.parametrize(("req", "name", "code"), BAD_REQUESTS)
def test_bad_request_names_the_field(req: Any, name: str, code: grpc.StatusCode) -> None:
    fn = validate_text_generate if isinstance(req, pb.TextGenerateRequest) else validate_generate
    err = _error(fn, req, LIMITS)
    assert err.code == code
    assert err.message.startswith(f"{name}: "), err.message


def test_context_length_edges() -> None:
    # 251 prompt tokens + 5 new = 256 = max_model_len: fits exactly.
    sp = pb.SamplingParams(max_new_tokens=5)
    validate_generate(pb.GenerateRequest(input_ids=[1] * 251, sampling_params=sp), LIMITS)
    err = _error(
        validate_generate, pb.GenerateRequest(input_ids=[1] * 252, sampling_params=sp), LIMITS
    )
    assert "use at most 4" in err.message


def test_defaulted_max_new_tokens_counts_too() -> None:
    # max_new_tokens defaults to 128 and must fit like a given one (it is not shrunk).
    small = Limits(max_model_len=64, vocab_size=100)
    err = _error(validate_generate, pb.GenerateRequest(input_ids=[1]), small)
    assert err.message.startswith("sampling_params.max_new_tokens: ")
    v = validate_generate(pb.GenerateRequest(input_ids=[1]), LIMITS)
    assert v.sampling.max_new_tokens == 128


def test_prompt_length_for_text_names_text() -> None:
    err = _error(lambda: check_prompt_length(256, 1, LIMITS, field_path="text"))
    assert err.message.startswith("text: ") and err.code == INVALID
    check_prompt_length(255, 1, LIMITS, field_path="text")


def test_tokenize_and_detokenize() -> None:
    validate_tokenize(pb.TokenizeRequest(text=" "))
    validate_tokenize(pb.TokenizeRequest())  # the empty text is valid (SGLang: count 0)
    validate_detokenize(pb.DetokenizeRequest(tokens=[0, 99]), LIMITS)
    validate_detokenize(pb.DetokenizeRequest(), LIMITS)
    err = _error(validate_detokenize, pb.DetokenizeRequest(tokens=[5, 100]), LIMITS)
    assert err.message.startswith("tokens[1]: ") and err.code == INVALID
    assert err.message.endswith("out of vocabulary")
    err = _error(validate_detokenize, pb.DetokenizeRequest(tokens=[5, -3]), LIMITS)
    assert err.message.startswith("tokens[1]: ") and "non-negative" in err.message


def test_seed_is_passed_through_only_when_given() -> None:
    assert not normalize_sampling(pb.SamplingParams()).HasField("seed")
    assert normalize_sampling(pb.SamplingParams(seed=42)).seed == 42
    err = _error(normalize_sampling, pb.SamplingParams(seed=-1))
    assert err.code == INVALID and err.message.startswith("sampling_params.seed")


def test_logprob_options_go_into_sampling_when_asked() -> None:
    v = validate_text_generate(pb.TextGenerateRequest(
        text="a", return_logprob=True, top_logprobs_num=20, logprob_start_len=0,
        return_text_in_logprobs=True), LIMITS)
    s = v.sampling
    assert s.return_logprob and s.top_logprobs_num == 20 and s.logprob_start_len == 0
    assert s.return_text_in_logprobs
    # Defaults: no top alternatives, no prompt logprobs, no texts.
    s = validate_generate(pb.GenerateRequest(input_ids=[1, 2], return_logprob=True),
                          LIMITS).sampling
    assert s.return_logprob and s.top_logprobs_num == 0 and s.logprob_start_len == -1
    assert not s.return_text_in_logprobs
    # The last prompt position is the last valid start.
    s = validate_generate(pb.GenerateRequest(input_ids=[1, 2], return_logprob=True,
                                             logprob_start_len=1, return_text_in_logprobs=True),
                          LIMITS).sampling
    assert s.logprob_start_len == 1 and s.return_text_in_logprobs


def test_logprob_options_are_ignored_without_return_logprob() -> None:
    s = validate_text_generate(pb.TextGenerateRequest(
        text="a", top_logprobs_num=5, logprob_start_len=3, return_text_in_logprobs=True),
        LIMITS).sampling
    assert not s.return_logprob and s.top_logprobs_num == 0 and s.logprob_start_len == -1
    assert not s.return_text_in_logprobs
    # A start past the prompt only matters when logprobs are asked.
    validate_generate(pb.GenerateRequest(input_ids=[1], logprob_start_len=5), LIMITS)


def test_logprob_errors_say_what_is_allowed() -> None:
    err = _error(validate_text_generate,
                 pb.TextGenerateRequest(text="a", return_logprob=True, top_logprobs_num=50),
                 LIMITS)
    assert err.message == "top_logprobs_num: must be in [0, 20], got 50"
    err = _error(validate_generate, pb.GenerateRequest(
        input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=3), LIMITS)
    assert err.message == (
        "logprob_start_len: must be less than the prompt's length (3 tokens), got 3")


def test_n_samples_stay_out_of_the_internal_params() -> None:
    assert validate_generate(pb.GenerateRequest(input_ids=[1]), LIMITS).n == 1
    for n in (1, 3, MAX_N):
        v = validate_text_generate(pb.TextGenerateRequest(
            text="a", sampling_params=pb.SamplingParams(n=n, seed=7)), LIMITS)
        assert v.n == n and v.sampling.seed == 7
    err = _error(normalize_sampling, pb.SamplingParams(n=MAX_N + 1))
    assert err.message == f"sampling_params.n: must be in [1, {MAX_N}] (samples of the prompt), " \
                          f"got {MAX_N + 1}"


def test_embed_requests() -> None:
    v = validate_embed(pb.EmbedRequest(input_ids=[1, 2, 99], rid="e1"), LIMITS)
    assert v.embed and v.input_ids == [1, 2, 99] and v.rid == "e1" and not v.stream
    assert v.sampling.max_new_tokens == 0 and not v.return_text
    v = validate_text_embed(pb.TextEmbedRequest(text="hello"))
    assert v.embed and v.text == "hello" and v.rid is None
    for fn, req, name in [
        (validate_text_embed, pb.TextEmbedRequest(), "text"),
        (validate_text_embed, pb.TextEmbedRequest(text="a", rid="a b"), "rid"),
        (lambda r: validate_embed(r, LIMITS), pb.EmbedRequest(), "input_ids"),
        (lambda r: validate_embed(r, LIMITS), pb.EmbedRequest(input_ids=[100]), "input_ids[0]"),
        # The whole context may hold the prompt, but no more (no room is kept for output).
        (lambda r: validate_embed(r, LIMITS), pb.EmbedRequest(input_ids=[1] * 256), "input_ids"),
    ]:
        err = _error(fn, req)
        assert err.code == INVALID and err.message.startswith(f"{name}: "), err.message
    validate_embed(pb.EmbedRequest(input_ids=[1] * 255), LIMITS)
