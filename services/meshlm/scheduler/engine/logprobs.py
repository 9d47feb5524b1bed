"""Logprobs of the model's own distribution: log_softmax of the raw logits (before penalties,
temperature and truncation), as SGLang and HF `output_logits` report them."""

from __future__ import annotations

import torch
from torch import Tensor

from meshlm.scheduler.engine.sequence import TopLogprobs


def log_softmax(logits: Tensor) -> Tensor:
    """float32 log-probabilities of each row [N, V]."""
    return logits.float().log_softmax(dim=-1)


def chosen_and_top(logp: Tensor, tokens: list[int], k: int
                   ) -> tuple[list[float], list[TopLogprobs]]:
    """Per row of `logp` [N, V]: the logprob of its token, and its top k (token, logprob)."""
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)[:, 0].tolist()
    return chosen, top(logp, k)


def ranks(logp: Tensor, tokens: list[int]) -> list[int]:
    """Per row of `logp` [N, V]: the rank of its token, 1 for the most likely (how many
    tokens are at least as likely as it, itself included)."""
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None]
    return (logp >= logp.gather(1, index)).sum(dim=-1).tolist()


def top(logp: Tensor, k: int) -> list[TopLogprobs]:
    """Per row of `logp` [N, V]: its k most likely (token, logprob), best first ([] if k 0)."""
    if not k:
        return [[] for _ in range(logp.shape[0])]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [list(zip(r_ids, r_vals, strict=True))
            for r_ids, r_vals in zip(ids.tolist(), values.tolist(), strict=True)]


def of_token_ids(logp: Tensor, rows: list[int], ids: list[tuple[int, ...]]) -> list[TopLogprobs]:
    """For each (row, asked ids) pair: (id, logprob) of every asked id at that row of `logp`,
    in the asked order (SGLang's token_ids_logprob). One gather for all rows."""
    if not rows:
        return []
    flat_rows = [r for r, wanted in zip(rows, ids, strict=True) for _ in wanted]
    flat_ids = [t for wanted in ids for t in wanted]
    device = logp.device
    values = logp[torch.tensor(flat_rows, dtype=torch.long, device=device),
                  torch.tensor(flat_ids, dtype=torch.long, device=device)].tolist()
    out: list[TopLogprobs] = []
    at = 0
    for wanted in ids:
        out.append(list(zip(wanted, values[at:at + len(wanted)], strict=True)))
        at += len(wanted)
    return out
