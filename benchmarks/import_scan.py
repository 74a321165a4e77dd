"""The package's imports, read from its source (nothing is imported): cycles, imports up the layers, and every
function-local import with the reason its comment gives.

    python benchmarks/import_scan.py [SRC]        # SRC: the package folder, src/triforce by default

Three sections:
- cycles: strongly connected groups of modules, first over module-level imports (what runs at import time;
  `if TYPE_CHECKING:` blocks left out, they never run), then with the function-local imports counted too (a
  cycle that only a deferred import keeps from failing);
- upward imports: a module of a lower layer (caches/, execution/, kernels/) importing anything of a higher one
  (speculation/, serving/, model.py), at module level or inside a function;
- function-local imports: each with its line and the comment on that line or on the comment lines just above it
  (or on the first import line of its group), "(no reason given)" when there is none.
Exit code 0 always: this reports, the reader judges.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

LOWER = ("caches", "execution", "kernels")
HIGHER = ("speculation", "serving", "model")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(root: Path, name: str) -> bool:
    return (root.parent / Path(*name.split(".")) / "__init__.py").exists()


def resolve(module: str, package: bool, level: int, target: str | None) -> str:
    """The absolute name `from <level dots><target>` means inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(tree: ast.Module):
    """(node, local) for every import statement: local when inside a function; TYPE_CHECKING blocks skipped."""
    def walk(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, local
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)
    yield from walk(tree, False)


def targets(root: Path, modules: set[str], name: str, node) -> list[str]:
    """The package's modules this import statement loads (outside names are dropped): the named module and the
    packages above it that the importer is not inside (importing caches.static from graphs.py runs
    caches/__init__.py first; from caches/full.py, caches/ is already being imported)."""
    top = root.name
    out = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = resolve(name, is_package(root, name), node.level, node.module)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    for n in names:
        while n and n not in modules:  # `import triforce.caches.full` -> the module; an attribute -> its module
            n = n.rpartition(".")[0]
        if not n or not (n == top or n.startswith(top + ".")):
            continue
        out.append(n)
        parent = n.rpartition(".")[0]
        while parent and parent != top and not (name == parent or name.startswith(parent + ".")):
            out.append(parent)
            parent = parent.rpartition(".")[0]
    return out


def reason(lines: list[str], node) -> str:
    """The comment on the import's own lines, else the comment lines right above it, else the comment on the
    first import of its group (consecutive import lines)."""
    for i in range(node.lineno - 1, node.end_lineno):
        if "#" in lines[i]:
            return lines[i].split("#", 1)[1].strip()
    above, i = [], node.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    if above:
        return " ".join(above)
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
        if "#" in lines[i]:
            return lines[i].split("#", 1)[1].strip()
        i -= 1
    return "(no reason given)"


def layer(top: str, name: str) -> str | None:
    rest = name[len(top) + 1:].split(".")[0] if name != top else ""
    return rest or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted, largest first."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda g: (-len(g), g))


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1] / "src" / "triforce").resolve()
    files = sorted(root.rglob("*.py"))
    modules = {module_name(root, f) for f in files}
    top = root.name
    eager: dict[str, set[str]] = {m: set() for m in modules}
    every: dict[str, set[str]] = {m: set() for m in modules}
    upward, local = [], []
    for f in files:
        name = module_name(root, f)
        text = f.read_text()
        lines = text.splitlines()
        for node, is_local in imports(ast.parse(text)):
            found = targets(root, modules, name, node)
            for t in found:
                if t == name:
                    continue
                every[name].add(t)
                if not is_local:
                    eager[name].add(t)
                if layer(top, name) in LOWER and layer(top, t) in HIGHER:
                    upward.append(f"{f.relative_to(root.parent)}:{node.lineno}: {name} -> {t}"
                                  f"{' (function-local)' if is_local else ''}")
            if is_local:
                code = " ".join(s.split("#", 1)[0].strip() for s in lines[node.lineno - 1:node.end_lineno])
                local.append((f"{f.relative_to(root.parent)}:{node.lineno}", code, reason(lines, node)))

    eager_cycles, every_cycles = cycles(eager), cycles(every)
    print(f"import scan of {top}/: {len(modules)} modules")
    print(f"cycles over module-level imports: {len(eager_cycles)}")
    for g in eager_cycles:
        print("  " + " <-> ".join(g))
    print(f"cycles with function-local imports counted: {len(every_cycles)}")
    for g in every_cycles:
        print("  " + " <-> ".join(g))
    print(f"upward imports ({'/'.join(LOWER)} -> {'/'.join(HIGHER)}): {len(upward)}")
    for u in upward:
        print("  " + u)
    given = sum(r != "(no reason given)" for _, _, r in local)
    print(f"function-local imports: {len(local)} ({given} with a comment, {len(local) - given} without)")
    for where, code, why in local:
        print(f"  {where}: {code}  # {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
