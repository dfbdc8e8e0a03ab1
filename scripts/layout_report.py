"""How the package hangs together: what a module pulls in, privates read across objects, size.

    python scripts/layout_report.py                         # the DDP wrapper's module
    python scripts/layout_report.py ddptrain.train.trainer  # another module

Counted from the source with `ast`, nothing imported:
- transitive imports: the package modules a module imports at module level (function-local
  imports and `if TYPE_CHECKING:` blocks do not count: they do not run on import), followed
  transitively; `from pkg import name` counts `pkg.name` when that is a module, else `pkg`, and
  importing `ddptrain.a.b` also runs `ddptrain/a/__init__.py` (the root `ddptrain/__init__.py`,
  which re-exports the public API, is left out: every module would otherwise pull in all);
- private reads: `x._name` where `x` is neither `self` nor `cls` nor a module from outside the
  package (`torch._C`, `dist._...` are torch's business), `_name` not a dunder;
- modules over 400 lines; import cycles (strongly connected groups), counted twice: over
  module-level imports, and over every import that can run (function-local ones too);
- the core (`ddptrain.ddp`) importing anything of the package outside it, even lazily.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ddptrain"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, level: int, here: str, is_package: bool) -> str:
    if level == 0:
        return name
    base = here.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements that run when the module is imported."""
    found = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import statement that can run: module level, in functions, in branches (not those
    under `if TYPE_CHECKING:`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped
    ]


def import_graph(mods: dict[str, Path], local: bool = False) -> dict[str, set[str]]:
    """module -> the package modules its module-level imports run (`local`: any import)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _all_imports(tree) if local else _top_level_imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _resolve(node.module or "", node.level, name, is_package)
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                    for alias in node.names
                ]
            for target in names:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    if prefix in mods and prefix != name:
                        targets.add(prefix)
        if name != PACKAGE:
            targets.discard(PACKAGE)
        graph[name] = targets
    return graph


def transitive(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing `start` runs (without `start` itself)."""
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen and nxt != start:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def private_reads(path: Path) -> list[tuple[int, str]]:
    """(line, expression) of reads of another object's `_private` member."""
    tree = ast.parse(path.read_text())
    outside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(PACKAGE):
                    outside.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if not (node.module or "").startswith(PACKAGE):
                outside.update(alias.asname or alias.name for alias in node.names)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__"):
            continue
        base = node.value
        root = base
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(root, ast.Name) and root.id in outside:
            continue
        if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        # A package's __init__ importing its own modules is no cycle: edges to ancestors skipped.
        for w in (w for w in graph[v] if not v.startswith(w + ".")):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strongconnect(v)
    return groups


def main() -> int:
    default = "ddptrain.ddp.wrapper"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("module", nargs="?", default=default, help="dotted module name")
    args = parser.parse_args()
    mods = modules()
    graph = import_graph(mods)
    deps = sorted(transitive(graph, args.module))
    lines = {name: len(path.read_text().splitlines()) for name, path in mods.items()}
    print(f"{args.module} ({lines[args.module]} lines) imports at module level, transitively:")
    print(f"  {len(deps)} package modules, {sum(lines[d] for d in deps)} lines")
    for d in deps:
        print(f"    {d} ({lines[d]})")
    reads = {name: private_reads(path) for name, path in mods.items()}
    total = sum(len(r) for r in reads.values())
    print(f"reads of other objects' private members: {total}")
    for name, found in reads.items():
        for line, expr in found:
            print(f"    {mods[name].relative_to(ROOT)}:{line}: {expr}")
    big = [(n, c) for n, c in lines.items() if c > 400]
    print(f"modules over 400 lines: {len(big)}")
    for name, count in big:
        print(f"    {name} ({count})")
    groups = cycles(graph)
    print(f"import cycles: {len(groups)}")
    for group in groups:
        print(f"    {' <-> '.join(group)}")
    every = import_graph(mods, local=True)
    groups = cycles(every)
    print(f"import cycles, function-local imports counted: {len(groups)}")
    for group in groups:
        print(f"    {' <-> '.join(group)}")
    core = f"{PACKAGE}.ddp"
    outward = sorted(
        (name, target)
        for name, targets in every.items()
        if name == core or name.startswith(core + ".")
        for target in targets
        if target != PACKAGE and not (target == core or target.startswith(core + "."))
    )
    print(f"imports from the core ({core}) to the rest of the package: {len(outward)}")
    for name, target in outward:
        print(f"    {name} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
