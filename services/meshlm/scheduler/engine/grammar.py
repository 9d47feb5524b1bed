"""Constrained decoding in the model runner: the tokens each sequence's grammar allows next,
as a mask over the vocabulary, and each token drawn fed back to it.

A sequence's matcher (an llguidance `LLMatcher`, built by `scheduler/grammar.py` before the
request is queued) is used here through three of its methods only: it writes the next allowed
tokens as a bitmask (32 ids per int32 word, lowest bit first), consumes a token, and says
whether it is complete or has failed. The engine itself never imports llguidance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor


def allowed_masks(matchers: Sequence[Any], vocab_size: int, device: torch.device) -> Tensor:
    """[len(matchers), vocab_size] bool: the ids each matcher allows next."""
    words = (vocab_size + 31) // 32
    bits = np.full((len(matchers), words), -1, dtype=np.int32)
    for row, matcher in zip(bits, matchers, strict=True):
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(unpacked.astype(np.bool_)).to(device)


def feed(matcher: Any, token: int) -> str | None:
    """Give the matcher the token drawn: "done" once its grammar is complete, why it refused
    the token (an error), or None while the output goes on."""
    if not matcher.consume_token(token) or matcher.is_error():
        why = (matcher.get_error() or "refused").splitlines()[0]  # its state left out
        return (f"the output constraint could not continue with token {token}: {why} (does "
                f"min_new_tokens or a banned token leave it nothing to draw?)")
    return "done" if matcher.is_stopped() else None
