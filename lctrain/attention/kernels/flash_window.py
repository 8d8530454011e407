"""flash-attn's window convention, shared by PyTorch's own flash kernels, flash-attn 2 and flash-attn 3."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def flash_window(q_len: int, k_len: int, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: query ``i`` sees keys ``i + k_len - q_len - left`` to
    ``i + k_len - q_len + right`` (bottom-right aligned; -1: no limit). Our band is top-left aligned, hence the
    shift (``>= 0``: the last query row sees a key); ``causal`` makes flash-attn's right edge 0 itself."""
    if window_left is None:
        return (-1, -1)
    return (window_left + k_len - q_len, 0 if causal else -1)


def parameter_names(fn: Callable) -> set[str]:
    """Parameter names of ``fn``, looking through ``torch.library.custom_op`` wrappers (whose own signature is
    ``(*args, **kwargs)``): flash-attn's private functions changed their argument names between versions."""
    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def window_arguments(fn: Callable, left: int, right: int) -> dict:
    """``window_size_left=, window_size_right=`` or ``window_size=(left, right)``, as ``fn`` spells it."""
    if "window_size_left" in parameter_names(fn):
        return {"window_size_left": left, "window_size_right": right}
    return {"window_size": (left, right)}
