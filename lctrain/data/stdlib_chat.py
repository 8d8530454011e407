"""The embedded chat corpus: questions about the standard library's functions, answered by their docstrings.

Made locally and deterministically from the source files (parsed with ``ast``, never imported, so nothing of them
runs), like the embedded text corpus; nothing is downloaded. Each file gives conversations about its public
functions and the public methods of its public classes that have a docstring: one to three questions each, asked
in one of a few phrasings, each answered with the docstring as ``inspect.cleandoc`` prints it; one conversation in
three opens with a system prompt. The choices are seeded by the file's path relative to the library, so every
machine with the same Python makes the same corpus.
"""

from __future__ import annotations

import ast
import json
import os
import random
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

SYSTEM_PROMPT = "You answer questions about the Python standard library."
QUESTIONS = (
    "What does `{name}({args})` in `{module}` do?",
    "Explain `{module}.{name}`.",
    "How do I use `{module}.{name}({args})`?",
    "In the `{module}` module, what is `{name}` for?",
)
FOLLOW_UPS = ("And `{name}({args})`?", "What about `{name}`?", "Now `{module}.{name}`, please.")


def module_name(path: str) -> str:
    """The dotted module name of a standard-library file."""
    relative = Path(os.path.relpath(path, sysconfig.get_paths()["stdlib"])).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


# CPython 3.11's ast.parse can fail with "SystemError: AST constructor recursion depth mismatch" when threads parse at
# once (python/cpython#106905), and datasets reads the training and validation sources from threads of its own
_PARSING = threading.Lock()


def parse_python(source: str) -> ast.Module:
    """``ast.parse(source)``, one thread at a time."""
    with _PARSING:
        return ast.parse(source)


def public_functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """(qualified name, node, docstring) of a module's public functions and its public classes' public methods that
    have a docstring, in source order."""
    for node in tree.body:
        members = [("", node)]
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            members += [(f"{node.name}.", member) for member in node.body]
        for prefix, member in members:
            if not isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) or member.name.startswith("_"):
                continue
            docstring = ast.get_docstring(member)
            if docstring and docstring.strip():
                yield prefix + member.name, member, docstring.strip()


def documented_functions(source: str) -> list[tuple[str, str, str]]:
    """(qualified name, arguments, docstring) of the public functions and public classes' public methods of a
    module's source that have a docstring, in source order."""
    functions = public_functions(parse_python(source))
    return [(name, ast.unparse(node.args), docstring) for name, node, docstring in functions]


def stdlib_conversations(paths: list[str]) -> Iterator[dict[str, str]]:
    """One ``{"record": <JSON of {"messages": [...]}>, "where": ...}`` per conversation about each file's functions,
    file by file in order (files that do not parse as UTF-8 Python are skipped)."""
    for path in paths:
        try:
            functions = documented_functions(Path(path).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = module_name(path)
        rng = random.Random(os.path.relpath(path, sysconfig.get_paths()["stdlib"]))
        start, number = 0, 0
        while start < len(functions):
            turns = functions[start : start + rng.randint(1, 3)]
            start += len(turns)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 1 / 3 else []
            for index, (name, args, docstring) in enumerate(turns):
                phrasing = rng.choice(QUESTIONS if index == 0 else FOLLOW_UPS)
                messages.append({"role": "user", "content": phrasing.format(name=name, args=args, module=module)})
                messages.append({"role": "assistant", "content": docstring})
            yield {"record": json.dumps({"messages": messages}), "where": f"{path} (conversation {number})"}
            number += 1
