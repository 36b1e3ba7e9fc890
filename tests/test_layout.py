"""The repository's shape: its own modules import one another without a cycle, counting imports inside functions
(a lazy import that closes a circle still ties the modules together), and a clone stands alone."""

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kv", "benchmarks", "evals", "scripts")


def own_modules() -> dict[str, Path]:
    files = list(REPO_ROOT.glob("*.py")) + [p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py")]
    modules = {}
    for path in files:
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that `path` imports anywhere in its body (top level or inside a function)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_lazy_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_not_even_inside_functions():
    modules = own_modules()
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how a package exposes them, not a cycle between files
    for name in PACKAGES:
        graph[name] = {m for m in graph.get(name, ()) if not m.startswith(name + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_repository_does_not_point_outside_itself():
    needle = "../" + "shared"
    offenders = [str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.rglob("*")
                 if p.suffix in {".py", ".md", ".yaml", ".toml"} and ".venv" not in p.parts
                 and needle in p.read_text(errors="ignore")]
    assert not offenders
