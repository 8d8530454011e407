"""A package's public names imported from their modules on first use (PEP 562's module ``__getattr__``), so that
the package's torch-free modules (``lctrain.data.config``, ``lctrain.models.config``: the sections of a job's
config) import without its torch ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import import_module


def lazy_exports(package: str, modules: Mapping[str, Sequence[str]]) -> tuple[list[str], Callable[[str], object]]:
    """``__all__`` and ``__getattr__`` for ``package`` whose names are ``modules`` (submodule -> names in it)."""
    where = {name: module for module, names in modules.items() for name in names}

    def attribute(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{where[name]}"), name)

    return sorted(where), attribute
