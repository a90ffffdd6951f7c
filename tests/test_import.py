"""The house rules of the Python packages: `tide` never loads a framework and imports no face
(tide_torch, tide_xla) nor tide_apps, not even lazily; tide_apps' CLI, demo and benches load a
framework only when they run; and no module of tide / tide_torch / tide_xla / tide_apps imports
itself back through another (lazy imports included)."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("tide", "tide_torch", "tide_xla", "tide_apps")
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "tide_torch", "tide_xla")
ABOVE_CORE = ("tide_torch", "tide_xla", "tide_apps")  # what `tide` must never import


def test_import_without_frameworks():
    """`import tide` works with neither torch nor jax importable."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['jax'] = None; "
            "import tide; print(tide.plan.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "plan" in out.stdout


def _loaded_frameworks(mods: list[str]) -> str:
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_tide_loads_no_framework():
    """With torch and jax installed, `import tide` (and its CLI) loads neither."""
    mods = [_module_name(p) for p in sorted((ROOT / "tide").rglob("*.py")) if p.stem != "__main__"]
    got = _loaded_frameworks(mods)
    assert got == "[]", f"framework modules loaded by tide: {got}"


def test_apps_cli_demo_and_benches_load_no_framework_until_they_run():
    """`tide plan`, `tide demo --no-train` and `tide bench --help` need no framework: tide_apps'
    CLI, demo and benches import torch / jax only inside the functions that use them."""
    mods = ["tide_apps", "tide_apps.cli", "tide_apps.demo", "tide_apps.llama_spec"]
    mods += [f"tide_apps.bench.{p.stem}" for p in sorted((ROOT / "tide_apps" / "bench").glob("*.py"))
             if p.stem != "__init__"]
    got = _loaded_frameworks(mods)
    assert got == "[]", f"framework modules loaded by tide_apps' CLI, demo or benches: {got}"


def test_tide_imports_no_face_and_no_apps_even_lazily():
    """Arrows point down: tide_apps -> tide_torch / tide_xla -> tide. Every import statement of
    every tide module (in functions too) is checked."""
    bad = {}
    for p in (ROOT / "tide").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                     [n.module or ""] if isinstance(n, ast.ImportFrom) and n.level == 0 else [])
            hits = [m for m in names if m.split(".")[0] in ABOVE_CORE]
            if hits:
                bad.setdefault(str(p.relative_to(ROOT)), []).extend(hits)
    assert not bad, f"tide imports a face or tide_apps: {bad}"


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
    assert "tide.cli" in graph and "tide_apps.demo" in graph and "tide_torch.comm" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a planted cycle is reported, a DAG is not."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
