"""The house's shape, read from the code's own imports: ``lctrain``'s parts stand in layers, each importing only from
layers below it (data flows one way: data -> sharding -> model -> loss -> optimizer -> checkpoint), no module
imports itself back through others, and no module outgrows one reader's sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lctrain"

# lowest first; a part may import from the layers before its own, never from its own layer's other parts or above
LAYERS = [
    {"rules", "flops", "checkpoint", "testing", "lazy"},  # torch-free rules, FLOPs, ...
    {"families"},  # the family records, and a config's FLOPs per token by its layers
    {"attention"},
    {"linear_attention"},  # mixers whose state passes between context-parallel ranks; Ulysses from attention
    {"parallel", "models", "data"},
    {"config"},
    {"runtime"},
    {"planner"},
    {"build", "ruler"},
    {"train"},
    {"eval"},
    {"cli"},
    {"__main__", "__init__"},
]
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every ``lctrain`` module ``path`` imports, at the top, inside functions and under ``TYPE_CHECKING`` alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lctrain":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "lctrain")
    return found


def part(module: str) -> str:
    """``lctrain.train.trainer`` -> ``train``; ``lctrain`` -> ``__init__``."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def layer(module: str) -> int:
    return next(index for index, parts in enumerate(LAYERS) if part(module) in parts)


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: {target for target in imports(path) if target in modules} for name, path in modules.items()}


def test_every_part_has_a_layer() -> None:
    unplaced = {part(module) for module in graph()} - set().union(*LAYERS)
    assert not unplaced, f"parts of lctrain without a layer in LAYERS: {sorted(unplaced)}"


def test_imports_go_down_the_layers() -> None:
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph().items()
        for target in targets
        if part(source) != part(target) and layer(target) >= layer(source)
    )
    assert not upward, "imports from a part's own layer or above:\n" + "\n".join(upward)


def test_no_import_circles() -> None:
    edges, state, path, circles = graph(), {}, [], []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    # a package's __init__ re-exporting its modules is not a circle back into it
    circles = [c for c in circles if not all(m.startswith(c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_modules_stay_readable() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by what they own): {long}"
