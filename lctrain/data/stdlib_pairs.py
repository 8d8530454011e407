"""The embedded preference corpus: the standard library's functions shown as code, each with its true docstring
preferred to a corrupted one.

Made locally and deterministically from the source files (parsed with ``ast``, never imported), like the embedded
chat corpus (``lctrain.data.stdlib_chat``), of the same files and splits. Each public function or public method with
a docstring and a body beside it gives one conversational pair: the prompt shows its code without the docstring
and asks for one (in one of a few phrasings; one prompt in three opens with a system prompt); ``chosen`` is the
docstring as ``inspect.cleandoc`` prints it, ``rejected`` the same words in a shuffled order, line lengths kept (the
same tokens, so only their order tells them apart). Functions longer than ``MAX_CODE`` characters or with a
docstring longer than ``MAX_DOCSTRING`` are left out, so that a pair fits a row of 1024 tokens of the embedded
tokenizer. The choices are seeded by the file's path relative to the library.
"""

from __future__ import annotations

import ast
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from lctrain.data.stdlib_chat import module_name, parse_python, public_functions

SYSTEM_PROMPT = "You write the docstrings of Python standard library functions."
REQUESTS = (
    "Here is `{name}` from `{module}`:\n\n```python\n{code}\n```\n\nWrite its docstring.",
    "What docstring does this function of `{module}` have?\n\n```python\n{code}\n```",
    "```python\n{code}\n```\n\nDocument `{module}.{name}`.",
)
MAX_CODE = 1200
MAX_DOCSTRING = 600


def _code_without_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    docstring = node.body[0]
    kept = lines[node.lineno - 1 : docstring.lineno - 1] + lines[docstring.end_lineno : node.end_lineno]
    indent = min(len(line) - len(line.lstrip()) for line in kept if line.strip())
    return "\n".join(line[indent:] for line in kept).strip()


def corrupted(docstring: str, rng: random.Random) -> str:
    """``docstring``'s words in a shuffled order, each line keeping its number of words."""
    lines = [line.split() for line in docstring.split("\n")]
    words = [word for line in lines for word in line]
    rng.shuffle(words)
    out, start = [], 0
    for line in lines:
        out.append(" ".join(words[start : start + len(line)]))
        start += len(line)
    return "\n".join(out)


def stdlib_pairs(paths: list[str]) -> Iterator[dict[str, str]]:
    """One ``{"record": <JSON of {"prompt", "chosen", "rejected"}>, "where": ...}`` per documented function of each
    file, file by file in order (files that do not parse as UTF-8 Python are skipped)."""
    for path in paths:
        try:
            source = Path(path).read_text(encoding="utf-8")
            functions = list(public_functions(parse_python(source)))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module, lines = module_name(path), source.split("\n")
        rng = random.Random(os.path.relpath(path, sysconfig.get_paths()["stdlib"]))
        number = 0
        for name, node, docstring in functions:
            if len(node.body) < 2 or len(docstring) > MAX_DOCSTRING:
                continue
            code = _code_without_docstring(lines, node)
            rejected = corrupted(docstring, rng)
            if len(code) > MAX_CODE or rejected == docstring:
                continue
            request = rng.choice(REQUESTS).format(name=name, module=module, code=code)
            prompt = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 1 / 3 else []
            prompt.append({"role": "user", "content": request})
            record = {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": docstring}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
            yield {"record": json.dumps(record), "where": f"{path} (pair {number})"}
            number += 1
