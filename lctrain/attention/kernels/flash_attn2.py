"""flash-attn 2 (optional extra `cuda`, package flash_attn): [B, S, H, D] natively, GQA natively, lse fp32; the
backward from the final (out, lse) is the private _flash_attn_(varlen_)backward, called by keyword.

flash_attn is imported inside the raw calls, when a kernel runs: importing this module needs no flash-attn."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import FUSED_CUDA, Platform
from lctrain.attention.kernels.flash import FlashOptions, flash_kernel, window_arguments

FLASH_ATTN_VARLEN_MIN = (2, 6)  # the varlen lse is [H, total_q] (unpadded) from flash-attn 2.6 on


def _attend(q: Tensor, k: Tensor, v: Tensor, options: FlashOptions) -> tuple[Tensor, Tensor]:
    import flash_attn

    attend = flash_attn.flash_attn_func if options.lengths is None else flash_attn.flash_attn_varlen_func
    out, lse, _ = attend(
        q,
        k,
        v,
        *(options.lengths or ()),
        0.0,
        options.scale,
        options.causal,
        window_size=options.window,
        return_attn_probs=True,
    )
    return out, lse


def _attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, options: FlashOptions
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn import flash_attn_interface

    if options.lengths is None:
        backward = flash_attn_interface._flash_attn_backward
    else:
        backward = flash_attn_interface._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(
        dout=dout,
        q=q,
        k=k,
        v=v,
        out=out,
        softmax_lse=lse,
        dq=dq,
        dk=dk,
        dv=dv,
        **options.length_arguments(),
        dropout_p=0.0,
        softmax_scale=options.scale,
        causal=options.causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **window_arguments(backward, *options.window),
    )
    return dq, dk, dv


def _installed(platform: Platform) -> str | None:
    if platform.flash_attn_version is None:
        return "flash_attn is not installed (pip install 'lctrain[cuda]')"
    return None


def _documents(platform: Platform) -> str | None:
    if platform.flash_attn_version < FLASH_ATTN_VARLEN_MIN:
        return "flash-attn < 2.6 returns a padded varlen lse"
    return None


FLASH_ATTN = flash_kernel(
    "flash_attn", _attend, _attend_backward, replace(FUSED_CUDA, available=_installed, documents=_documents)
)
