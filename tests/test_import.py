"""The house rules of the Python packages: `tide` never loads a framework, and no module of
tide / tide_torch / tide_xla imports itself back through another (lazy imports included)."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("tide", "tide_torch", "tide_xla")
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "tide_torch", "tide_xla")


def test_import_without_frameworks():
    """`import tide` works with neither torch nor jax importable."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['jax'] = None; "
            "import tide; print(tide.plan.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "plan" in out.stdout


def test_import_tide_loads_no_framework():
    """With torch and jax installed, `import tide` (and its CLI, demo, benches) loads neither."""
    mods = ["tide", "tide.cli", "tide.demo", "tide.report", "tide.cluster", "tide.options"]
    mods += [f"tide.bench.{p.stem}" for p in sorted((ROOT / "tide" / "bench").glob("*.py")) if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"framework modules loaded by tide: {out.stdout}"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_framework_imports(tree: ast.Module):
    """Framework imports outside any function or class body (executed at import time)."""
    todo = list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(n, ast.Import):
            yield from (a.name for a in n.names if a.name.split(".")[0] in FRAMEWORKS)
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module.split(".")[0] in FRAMEWORKS:
            yield n.module
        todo.extend(ast.iter_child_nodes(n))


def test_tide_has_no_module_level_framework_import():
    bad = {}
    for p in (ROOT / "tide").rglob("*.py"):
        found = list(_top_level_framework_imports(ast.parse(p.read_text())))
        if found:
            bad[str(p.relative_to(ROOT))] = found
    assert not bad, f"tide imports a framework at module level: {bad}"


def _import_graph():
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files) | {"tide._core", "tide_xla._ffi"}
    graph = {}
    for name, p in files.items():
        pkg = name if p.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - (n.level - 1)]
                    base = ".".join(up + ([n.module] if n.module else []))
                for a in n.names:
                    full = f"{base}.{a.name}"
                    deps.add(full if full in known else base)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
        graph[name] = {d for d in deps if d in known and d != name}
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None (iterative three-colour DFS)."""
    colour = dict.fromkeys(graph, 0)
    for root in graph:
        if colour[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        colour[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt, 2) == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, 2) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def test_module_graph_has_no_cycles():
    graph = _import_graph()
    assert "tide.cli" in graph and "tide.demo" in graph and "tide_torch.comm" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a planted cycle is reported, a DAG is not."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
