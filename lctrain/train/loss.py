"""Token-summed cross-entropy over the vocabulary head, computed in chunks of tokens.

At long context the logits ``[tokens, vocab]`` are the largest activation of the model (128K tokens × 128K vocab
in fp32 is 64 GiB). ``chunked_cross_entropy`` never holds more than ``chunk_tokens × vocab`` of them: each chunk's
logits are computed, reduced to a loss *and to its gradients* (softmax − one-hot is known in the forward), then
freed. The backward only scales the stored gradients of the hidden states and the head's weight, so nothing is
recomputed: three matmuls per chunk, as for the full logits.

Precision. The head's weight gradient sums over every token, so it is accumulated in fp32 over the chunks (never
rounded to the compute dtype between chunks). With bf16 inputs on CUDA the three matmuls run in bf16 on tensor cores
with fp32 outputs (``torch.mm``/``torch.baddbmm`` with ``out_dtype=torch.float32``, torch 2.8+): fp32 logits, and
the weight gradient added by the GEMM itself into the fp32 accumulator. Elsewhere (CPU; fp32 or fp16 weights) the
logits are the matmul in the inputs' dtype, then upcast, and the weight gradient an fp32 ``addmm_``.

The caller divides the sum by the number of valid tokens over every rank that shares the step (dp × ring ×
ulysses and the gradient-accumulation micro-batches), so that the loss equals the mean over the global batch.
``chunked_cross_entropy_by_group`` also sums the token losses by a group index per token (the source of each token
in a mixture, a position bucket in validation), from the same chunks: no logits are computed twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.data.packing import IGNORE_INDEX


def _tensor_cores(hidden: Tensor, weight: Tensor) -> bool:
    """Whether the chunks' matmuls run in bf16 with fp32 outputs: bf16 inputs on CUDA (CPU has no such kernel).
    fp16 stays on the fp32 path: rounding the softmax gradient (~1/vocab) to fp16 would lose it to subnormals."""
    return weight.is_cuda and weight.dtype == torch.bfloat16 and hidden.dtype == weight.dtype


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of bf16 ``[m, k]`` and ``[k, n]`` as an fp32 ``[m, n]``, on tensor cores."""
    return torch.mm(a, b, out_dtype=torch.float32)


def _addmm_fp32_(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """``accumulator += a @ b`` in place: fp32 ``[m, n]``, bf16 ``a [m, k]`` and ``b [k, n]``; the GEMM adds into
    the fp32 accumulator itself (``addmm`` with ``out_dtype`` wants its input in the inputs' dtype, ``baddbmm``
    does not)."""
    accumulator = accumulator[None]
    torch.baddbmm(accumulator, a[None], b[None], out_dtype=torch.float32, out=accumulator)


def _chunk_backward(
    grad_logits: Tensor,
    chunk: Tensor,
    weight: Tensor,
    rows: slice,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    tensor_cores: bool,
) -> None:
    """From one chunk's fp32 ``grad_logits`` ``[chunk, V]``: its hidden states' gradient into ``grad_hidden[rows]``,
    and the head's added to ``grad_weight`` (fp32, or the weight's dtype when wider); None: not wanted."""
    if tensor_cores:
        grad_logits = grad_logits.to(weight.dtype)  # bf16, as the other input of both matmuls
    if grad_hidden is not None:
        grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight
    if grad_weight is not None and tensor_cores:
        _addmm_fp32_(grad_weight, grad_logits.t(), chunk)
    elif grad_weight is not None:
        grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), chunk.to(grad_weight.dtype))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        chunk_tokens: int,
        needs_grad: bool,
        groups: Tensor | None,
        num_groups: int,
    ) -> tuple[Tensor, Tensor]:
        """hidden ``[T, H]``, weight ``[V, H]``, labels ``[T]``, groups ``[T]`` int64 or None -> the summed loss
        (fp32 scalar) and the summed loss per group (fp64 ``[num_groups]``, not differentiable)."""
        total = hidden.new_zeros((), dtype=torch.float32)
        group_sums = hidden.new_zeros(num_groups, dtype=torch.float64)
        grad_hidden = torch.zeros_like(hidden) if needs_grad and hidden.requires_grad else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # the head's gradient sums over all tokens
        grad_weight = (
            torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
            if needs_grad and weight.requires_grad
            else None
        )
        tensor_cores = _tensor_cores(hidden, weight)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk, targets = hidden[rows], labels[rows]
            valid = targets != IGNORE_INDEX
            targets = targets.clamp(min=0)[:, None]  # ignored rows pick class 0, then are masked out
            logits = _mm_fp32(chunk, weight.t()) if tensor_cores else (chunk @ weight.t()).float()  # [chunk, V]
            lse = torch.logsumexp(logits, dim=-1)
            token_losses = (lse - logits.gather(1, targets).squeeze(1)) * valid  # [chunk]
            total += token_losses.sum()
            if groups is not None:
                group_sums.index_add_(0, groups[rows], token_losses.double())
            if grad_hidden is None and grad_weight is None:
                continue
            # d(summed loss)/d(logits) = softmax - one-hot, zero on ignored rows; computed in place in the logits
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits.scatter_add_(1, targets, torch.full_like(lse[:, None], -1.0))
            grad_logits.mul_(valid[:, None])
            _chunk_backward(grad_logits, chunk, weight, rows, grad_hidden, grad_weight, tensor_cores)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        ctx.mark_non_differentiable(group_sums)
        return total, group_sums

    @staticmethod
    def backward(ctx, grad_total: Tensor, grad_group_sums: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.to(torch.float32)
        return (
            None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * scale.to(grad_weight.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int = 1024
) -> tuple[Tensor, Tensor]:
    """(summed loss, number of valid tokens) of ``logits = hidden @ weight.T`` against ``labels``.

    hidden ``[..., H]``, weight ``[vocab, H]`` (the LM head, no bias), labels ``[...]`` already shifted, with
    ``IGNORE_INDEX`` for tokens that predict nothing. Logits are reduced in fp32, ``chunk_tokens`` at a time (the
    module docstring says where the matmuls run).
    """
    total, _ = _chunked(hidden, weight, labels, None, 1, chunk_tokens)
    return total, (labels != IGNORE_INDEX).sum()


def chunked_cross_entropy_by_group(
    hidden: Tensor, weight: Tensor, labels: Tensor, groups: Tensor, num_groups: int, *, chunk_tokens: int = 1024
) -> tuple[Tensor, Tensor, Tensor]:
    """``chunked_cross_entropy``'s summed loss (the same value, differentiable), and per group: the summed loss
    (fp64 ``[num_groups]``, detached) and the number of valid tokens (int64 ``[num_groups]``). ``groups`` is an
    integer tensor of the labels' shape with values in ``[0, num_groups)``."""
    if groups.shape != labels.shape:
        raise ValueError(f"groups {tuple(groups.shape)} and labels {tuple(labels.shape)} differ in shape")
    groups = groups.reshape(-1).long()
    total, sums = _chunked(hidden, weight, labels, groups, num_groups, chunk_tokens)
    counts = torch.zeros(num_groups, dtype=torch.int64, device=labels.device)
    counts.index_add_(0, groups, (labels.reshape(-1) != IGNORE_INDEX).long())  # no boolean indexing: no host sync
    return total, sums, counts


def _chunked(
    hidden: Tensor, weight: Tensor, labels: Tensor, groups: Tensor | None, num_groups: int, chunk_tokens: int
) -> tuple[Tensor, Tensor]:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, H]
    labels = labels.reshape(-1)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, needs_grad, groups, num_groups)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
        """hidden ``[T, H]``, weight ``[V, H]``, labels ``[T]`` (all valid) -> fp32 ``[T]``: each label's log-prob."""
        logprobs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        tensor_cores = _tensor_cores(hidden, weight)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk = hidden[rows]
            logits = _mm_fp32(chunk, weight.t()) if tensor_cores else (chunk @ weight.t()).float()  # [chunk, V]
            logprobs[rows] = logits.gather(1, labels[rows, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens = chunk_tokens
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor) -> tuple[Tensor | None, ...]:
        """Each chunk's logits again (the gradient of a token's log-prob depends on its own weight, known only now):
        d logp_t / d logits_t = one-hot - softmax, scaled by the token's incoming gradient."""
        hidden, weight, labels = ctx.saved_tensors
        tensor_cores = _tensor_cores(hidden, weight)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            chunk, targets = hidden[rows], labels[rows, None]
            logits = _mm_fp32(chunk, weight.t()) if tensor_cores else (chunk @ weight.t()).float()
            grad_logits = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_().neg_()  # -softmax
            grad_logits.scatter_add_(1, targets, torch.ones_like(targets, dtype=grad_logits.dtype))
            grad_logits.mul_(grad_logprobs[rows, None].float())
            _chunk_backward(grad_logits, chunk, weight, rows, grad_hidden, grad_weight, tensor_cores)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int = 1024) -> Tensor:
    """The log-prob of each label under ``logits = hidden @ weight.T``: hidden ``[T, H]``, weight ``[vocab, H]``,
    labels ``[T]`` (every one a token id, none ``IGNORE_INDEX``) -> fp32 ``[T]``, differentiable in hidden and weight
    with a gradient per token (the preference losses weight each completion's tokens differently).

    ``chunk_tokens`` logits at a time, forward and backward (the backward computes each chunk's logits again: the
    tokens' weights are only known then); the matmuls run as in ``chunked_cross_entropy``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [T, H] and labels {tuple(labels.shape)} [T]")
    return _ChunkedTokenLogprobs.apply(hidden, weight, labels, chunk_tokens)
