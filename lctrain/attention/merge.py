"""The online-softmax merge of partial attention results, accumulated in fp32 (fp64 for fp64 inputs)."""

from __future__ import annotations

import torch
from torch import Tensor


def merge_block(out_acc: Tensor, lse_acc: Tensor, out_block: Tensor, lse_block: Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the running accumulators, in place.

    out_acc ``[B, S, H, D]`` and lse_acc ``[B, H, S]`` are the accumulators (views of them are fine: a block may
    cover only some rows); out_block has out_acc's shape in any dtype, lse_block lse_acc's shape. A row with
    ``lse = -inf`` has seen no key and contributes nothing; two such rows stay ``-inf`` without producing NaN.
    """
    lse_new = torch.logaddexp(lse_acc, lse_block)
    finite_new = torch.where(torch.isinf(lse_new), torch.zeros_like(lse_new), lse_new)
    weight_acc = torch.exp(lse_acc - finite_new).transpose(1, 2).unsqueeze(-1)  # [B, H, S] -> [B, S, H, 1]
    weight_block = torch.exp(lse_block - finite_new).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(weight_acc).add_(out_block.to(out_acc.dtype) * weight_block)
    lse_acc.copy_(lse_new)
