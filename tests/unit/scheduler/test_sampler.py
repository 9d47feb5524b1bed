"""Sampler on crafted logits: each parameter's semantics, seeds, and the draw's distribution."""

from __future__ import annotations

import pytest
import torch

from meshlm.scheduler.engine.sampler import (
    Sampler,
    SamplingBatch,
    argmax_rows,
    completing,
    top_k_mask,
    top_p_floor,
)
from meshlm.scheduler.engine.sequence import SamplingParams

CPU = torch.device("cpu")
V = 8


def batch(
    params: list[SamplingParams],
    generated: list[int] | None = None,
    seeds: list[int | None] | None = None,
    eos: tuple[int, ...] = (0,),
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, generated or [0] * n, eos, seeds or [None] * n, V, CPU)


def sample(logits: torch.Tensor, b: SamplingBatch, **kw: torch.Tensor) -> list[int]:
    return Sampler().sample(logits.clone(), b, **kw).tolist()


def test_greedy_is_exact_argmax() -> None:
    logits = torch.randn(16, V)
    b = batch([SamplingParams(temperature=0.0)] * 16)
    assert b.all_greedy
    assert sample(logits, b) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype: torch.dtype) -> None:
    """Ties go to the first id, a NaN wins, strided rows read right: as torch's argmax."""
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[1, 7] = logits[1, 250] = 50.0
    logits[2, 40] = float("nan")
    logits[3] = float("-inf")
    for view in (logits, logits[:, ::3], logits.t().contiguous().t()):
        assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(logits)[1] == 7 and argmax_rows(logits)[2] == 40


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(32, V) * 3
    expect = logits.argmax(-1).tolist()
    assert sample(logits, batch([SamplingParams(top_k=1)] * 32)) == expect
    assert sample(logits, batch([SamplingParams(top_p=1e-6)] * 32)) == expect
    assert sample(logits, batch([SamplingParams(min_p=0.999)] * 32)) == expect


def test_top_k_top_p_restrict_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]]).repeat(400, 1)
    assert set(sample(logits, batch([SamplingParams(top_k=3)] * 400))) == {0, 1, 2}
    # probabilities ~ .64 .23 .09 ...: top_p=0.8 keeps the first two
    assert set(sample(logits, batch([SamplingParams(top_p=0.8)] * 400))) == {0, 1}
    # min_p=0.3: keep p >= 0.3 * 0.64
    assert set(sample(logits, batch([SamplingParams(min_p=0.3)] * 400))) == {0, 1}


def test_draw_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = probs.log().repeat(20000, 1)
    got = torch.bincount(
        torch.tensor(sample(logits, batch([SamplingParams()] * 20000))), minlength=V
    )
    assert torch.allclose(got[:3].float() / 20000, probs[:3], atol=0.015)
    hot = sample(logits, batch([SamplingParams(temperature=100.0)] * 20000))
    assert set(hot) == {0, 1, 2}  # zero-probability tokens stay impossible at any temperature


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1, -5, -5, -5, -5]])
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, 0] = seen[0, 2] = True
    b = batch([SamplingParams(temperature=0.0, repetition_penalty=2.0)])
    assert sample(logits, b, seen=seen) == [1]  # 2.0 / 2 = 1.0 < 1.9
    pen = Sampler.penalize(logits.clone(), b, seen, None)
    assert pen[0, :4].tolist() == [1.0, pytest.approx(1.9), -2.0, pytest.approx(-1.1)]


def test_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, 0, 0, 0, 0, 0]])
    counts = torch.zeros(1, V, dtype=torch.int32)
    counts[0, 0] = 2
    b = batch([SamplingParams(temperature=0.0, frequency_penalty=0.2, presence_penalty=0.3)])
    pen = Sampler.penalize(logits.clone(), b, None, counts)
    assert pen[0, 0].item() == pytest.approx(3.0 - 0.4 - 0.3) and pen[0, 1].item() == 2.5
    assert sample(logits, b, counts=counts) == [1]


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0, 0, 0, 0, 0]] * 3)
    params = [
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(1,)),
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(1,)),
        SamplingParams(temperature=0.0, min_new_tokens=2, ignore_eos=True),
    ]
    # row 0 still under min (EOS 0 and stop 1 banned), row 1 reached it, row 2 ignores EOS
    assert sample(logits, batch(params, generated=[1, 2, 0])) == [2, 0, 0]


def test_seeded_rows_depend_on_seed_and_step_only() -> None:
    logits = torch.zeros(1, V)

    def draws(seed: int, rows: int, row: int) -> list[int]:
        seeds: list[int | None] = [None] * rows
        seeds[row] = seed
        out = []
        for step in range(20):  # the step-th token of the request
            generated = [step] * rows
            b = batch([SamplingParams()] * rows, generated=generated, seeds=seeds)
            out.append(sample(logits.repeat(rows, 1), b)[row])
        return out

    alone = draws(1234, 1, 0)
    assert draws(1234, 5, 3) == alone
    assert draws(1234, 9, 0) == alone
    assert draws(99, 1, 0) != alone
    assert len(set(alone)) > 1  # the draw moves on with the step


def test_mixed_batch_greedy_rows_untouched() -> None:
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=3)] * 3
    b = batch(params)
    assert not b.all_greedy and b.top_ks is not None and b.top_ks.tolist()[0] == V
    out = sample(logits, b)
    assert out[0::2] == logits.argmax(-1)[0::2].tolist()


def reference_support(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Tokens HF's TopK then TopP warpers would keep, by a plain full sort."""
    order = row.argsort(descending=True).tolist()
    if k > 0:
        order = order[:k]
    probs = row[order].softmax(-1).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs, strict=True):
        if kept and p < 1 and mass >= p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


@pytest.mark.parametrize("vocab", [8, 300, 5000])
def test_top_k_top_p_support_matches_full_sort(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    # from flat (wide nuclei: the sort fallback) to peaked rows
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.05, 6, rows)[:, None]
    ks = [0 if i % 3 == 0 else [1, 5, 50, vocab + 3][i % 4] for i in range(rows)]
    ps = [[1.0, 0.9, 0.5, 1e-6, 0.999][i % 5] for i in range(rows)]
    params = [SamplingParams(top_k=k or -1, top_p=p) for k, p in zip(ks, ps, strict=True)]
    b = SamplingBatch.build(params, [0] * rows, (), [None] * rows, vocab, CPU)
    masked = logits.clone()
    if b.top_ks is not None:
        masked = top_k_mask(masked, b.top_ks, b.top_k_cap)
    if b.top_ps is not None:
        masked = masked.masked_fill(masked < top_p_floor(masked, b.top_ps), float("-inf"))
    for i in range(rows):
        got = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        want = reference_support(logits[i], ks[i] if ks[i] < vocab else 0, ps[i])
        # float32 vs float64 cumulative sums may disagree on the one token at the cut
        assert (got <= want or want <= got) and len(got ^ want) <= 1, (i, got ^ want)


def test_logit_bias_is_added_per_row_before_anything_else() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    rows = [SamplingParams(temperature=0.0, logit_bias=((1, 100.0),)),  # all but forced
            SamplingParams(temperature=0.0, logit_bias=((0, -100.0), (2, 3.0))),
            SamplingParams(temperature=0.0)]  # no bias: untouched beside the others
    b = batch(rows)
    assert b.bias is not None and b.all_greedy
    assert not rows[0].plain_greedy and rows[2].plain_greedy
    assert sample(logits, b) == [1, 2, 0]
    # Sampled rows too: -100 leaves a token e^-95 of the rest's mass, never drawn here.
    hot = [SamplingParams(temperature=1.0, logit_bias=((0, -100.0),))] * 64
    assert 0 not in sample(torch.zeros(64, V).index_fill_(1, torch.tensor([0]), 5.0), batch(hot))
    # min_new_tokens' ban wins over a bias that would lift the eos.
    eos_up = SamplingParams(temperature=0.0, min_new_tokens=2, logit_bias=((0, 100.0),))
    assert sample(torch.zeros(1, V), batch([eos_up], generated=[0])) != [0]
    assert SamplingParams(logit_bias=((3, float("nan")),)).problem() is not None


def test_allowed_token_ids_restrict_a_row_before_the_bias() -> None:
    logits = torch.arange(V, dtype=torch.float32).repeat(3, 1)  # the last id is the argmax
    rows = [SamplingParams(temperature=0.0, allowed_token_ids=(1, 2)),
            SamplingParams(temperature=0.0, allowed_token_ids=(1, 2), logit_bias=((1, 5.0),)),
            SamplingParams(temperature=0.0)]
    b = batch(rows)
    assert b.allowed is not None and not rows[0].plain_greedy
    assert sample(logits, b) == [2, 1, V - 1]
    drawn = sample(torch.zeros(200, V), batch([SamplingParams(allowed_token_ids=(3, 5))] * 200))
    assert set(drawn) == {3, 5}
    assert SamplingParams(allowed_token_ids=(-1,)).problem() is not None


def test_bad_words_ban_the_id_that_would_complete_one() -> None:
    words = ((7,), (3, 4), (1, 2, 5))
    assert completing(words, []) == {7}
    assert completing(words, [9, 3]) == {7, 4}
    assert completing(words, [1, 2]) == {7, 5}
    assert completing(words, [2, 1]) == {7}
    params = [SamplingParams(temperature=0.0, bad_words=((3, 4),)), SamplingParams()]
    batch = SamplingBatch.build(params, [1, 1], (), [None, None], 8, torch.device("cpu"),
                                generated=[[3], [3]])
    assert batch.banned is not None
    assert [t.tolist() for t in batch.banned] == [[0], [4]]
    logits = torch.zeros(2, 8)
    logits[:, 4] = 5.0
    assert Sampler().sample(logits, batch).tolist()[1] == 4  # the other row may draw it
    assert Sampler().sample(logits.clone(), batch).tolist()[0] != 4
