"""flash-attn 3 (Hopper; module flash_attn_interface, built from flash-attention's hopper/ directory). Public
flash_attn_func / flash_attn_varlen_func with return_attn_probs=True give (out, lse); the backward from the
final (out, lse) is the private _flash_attn_backward, called by keyword (its names moved between versions).

flash_attn_interface is imported inside the raw calls, when a kernel runs: importing this module needs none."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import FUSED_CUDA, Platform
from lctrain.attention.kernels.flash import FlashOptions, flash_kernel, parameter_names, window_arguments


def _attend(q: Tensor, k: Tensor, v: Tensor, options: FlashOptions) -> tuple[Tensor, Tensor]:
    import flash_attn_interface

    if options.lengths is None:
        attend = flash_attn_interface.flash_attn_func
    else:
        attend = flash_attn_interface.flash_attn_varlen_func
    keywords = dict(softmax_scale=options.scale, causal=options.causal, window_size=options.window)
    if "return_attn_probs" in parameter_names(attend):  # later versions return (out, lse) only when asked
        keywords["return_attn_probs"] = True
    result = attend(q, k, v, *(options.lengths or ()), **keywords)
    if not isinstance(result, tuple) or len(result) < 2:
        raise RuntimeError("flash_attn_interface returned no log-sum-exp: this flash-attn 3 version is unsupported")
    return result[0], result[1]


def _attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, options: FlashOptions
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn_interface import _flash_attn_backward as backward

    names = parameter_names(backward)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    arguments = dict(
        dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, softmax_scale=options.scale
    )
    arguments["is_causal" if "is_causal" in names else "causal"] = options.causal
    arguments.update(window_arguments(backward, *options.window), **options.length_arguments())
    missing = set(arguments) - names
    if missing:
        raise RuntimeError(f"flash_attn_interface._flash_attn_backward takes no {sorted(missing)}: unsupported version")
    backward(**arguments)
    return dq, dk, dv


def _installed_on_hopper(platform: Platform) -> str | None:
    if not platform.flash_attn3:
        return "flash_attn_interface (flash-attn 3, built from flash-attention's hopper/) is not installed"
    if platform.capability[0] != 9:
        return f"flash-attn 3 is built for Hopper (compute capability 9.x), not {platform.capability}"
    return None


FLASH_ATTN3 = flash_kernel(
    "flash_attn3", _attend, _attend_backward, replace(FUSED_CUDA, available=_installed_on_hopper)
)
