"""The ground truth for attention tests: float64 math attention on the full sequence, per document if packed."""

from __future__ import annotations

import torch

from lctrain.attention.kernels import reference_attention


def reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool,
    bounds: list[int] | None = None,
    window: int | None = None,
) -> list[torch.Tensor]:
    """out, dq, dk, dv of float64 attention ``[B, S, H, D]``, run separately on each document of ``bounds``,
    with a sliding ``window`` (keys per query, itself included) when given."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    bounds = bounds or [0, q.shape[1]]
    out = torch.cat(
        [
            reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal, window=window)
            for a, b in zip(bounds, bounds[1:])
        ],
        dim=1,
    )
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]
