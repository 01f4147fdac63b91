"""The library's layering: pipeline/ sub-packages import only their own layer and the layers below it, never
stages/, nor Ray outside the Ray executor's room (pipeline/executor/ray/, which only stages/ imports), and no module
takes part in an import cycle. Every import counts, a function-level one too.

Layers, bottom up (each sub-package's __init__ says its job and what it may import):
  io < policy < runtime < data < training < evaluation < decoding < labelling < executor;  pipeline.tiny (the builder of the bundled
  pair) imports no other layer. The root package (version, ASSETS) may be imported from anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["io", "policy", "runtime", "data", "training", "evaluation", "decoding", "labelling", "executor"]
RANK = {name: i for i, name in enumerate(LAYERS)}
# The Ray executor's room: the one place in pipeline/ that imports Ray (beside the local executor, as datatrove keeps
# executor/{local,slurm,ray}.py); stages/ picks the executor, nothing else in the library imports it.
RAY_ROOM = "pipeline.executor.ray"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported module, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for alias in node.names:  # `from pipeline import io` imports the sub-package pipeline.io
                yield f"{mod}.{alias.name}", node.lineno


def _layer(module: str):
    """The sub-package a module belongs to; None for the root package's own names (pipeline.__version__)."""
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) < 2 or not (ROOT / "pipeline" / parts[1] / "__init__.py").is_file():
        return None
    return parts[1]


def _graph():
    files = sorted((ROOT / "pipeline").rglob("*.py"))
    modules = {_module_name(f): f for f in files}
    edges = {}
    for name, f in modules.items():
        edges[name] = [(m, line) for m, line in _imports(f)]
    return modules, edges


def upward_imports(modules, edges):
    bad = []
    for name, imports in edges.items():
        own = _layer(name)
        for target, line in imports:
            where = f"{modules[name].relative_to(ROOT)}:{line}"
            top = target.split(".")[0]
            in_room = name == RAY_ROOM or name.startswith(RAY_ROOM + ".")
            if top in ("stages", "jobs") or (top == "ray" and not in_room):
                bad.append(f"{where} imports {target} (the library is Ray-free outside {RAY_ROOM}, and below "
                           "stages/)")
                continue
            if (target == RAY_ROOM or target.startswith(RAY_ROOM + ".")) and not in_room:
                bad.append(f"{where} imports {target} (only stages/ and the room itself use the Ray executor)")
                continue
            other = _layer(target)
            if other is None or other == own or own is None:
                continue
            if own == "tiny" or other == "tiny":
                bad.append(f"{where}: {name} -> {target} (pipeline.tiny stands alone)")
            elif other in RANK and own in RANK and RANK[other] > RANK[own]:
                bad.append(f"{where}: {own} imports {other}, a layer above it ({target})")
            elif other not in RANK or own not in RANK:
                bad.append(f"{where}: {name} -> {target}: a sub-package missing from LAYERS")
    return bad


def cycles(modules, edges):
    graph = {n: sorted({t for t, _ in imps if t in modules and t != n}) for n, imps in edges.items()}
    found, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                found.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n)
    return found


def test_no_upward_import_and_no_cycle():
    modules, edges = _graph()
    assert set(LAYERS) <= {_layer(m) for m in modules}, "a layer in LAYERS has no package"
    assert upward_imports(modules, edges) == []
    assert cycles(modules, edges) == []


def test_every_sub_package_opens_with_its_job():
    for init in sorted((ROOT / "pipeline").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc.lower(), f"{init.relative_to(ROOT)} needs a docstring saying its job and what it imports"


def test_the_checks_can_fail(tmp_path):
    """The walker sees an upward import, a function-level one, an import of stages and a cycle."""
    modules = {"pipeline.io.a": tmp_path / "a.py", "pipeline.io.b": tmp_path / "b.py",
               "pipeline.policy.c": tmp_path / "c.py"}
    for p in modules.values():
        p.touch()
    for sub in ("io", "policy", "decoding"):
        (tmp_path / "pipeline" / sub).mkdir(parents=True)
        (tmp_path / "pipeline" / sub / "__init__.py").touch()
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        edges = {"pipeline.io.a": [("pipeline.decoding.engine", 3), ("pipeline.io.b", 4), ("ray", 5),
                                   ("pipeline.executor.ray.pool", 6)],
                 "pipeline.io.b": [("pipeline.io.a", 1)], "pipeline.policy.c": [("stages.train", 9)]}
        bad = upward_imports(modules, edges)
        assert any("io imports decoding" in b for b in bad) and any("stages.train" in b for b in bad)
        assert any("a.py:5 imports ray " in b for b in bad) and any("a.py:6 imports pipeline.executor.ray" in b
                                                                     for b in bad)
        room = {"pipeline.executor.ray.pool": tmp_path / "a.py"}  # the room itself may import Ray
        assert upward_imports(room, {"pipeline.executor.ray.pool": [("ray", 1)]}) == []
        assert cycles(modules, edges) == ["pipeline.io.a -> pipeline.io.b -> pipeline.io.a"]
    finally:
        ROOT = saved
    f = tmp_path / "pipeline" / "io" / "x.py"
    f.write_text("def f():\n    from pipeline.labelling import replay\n")
    ROOT = tmp_path
    try:
        assert ("pipeline.labelling.replay", 2) in list(_imports(f))
    finally:
        ROOT = saved


if __name__ == "__main__":
    pytest.main([__file__])
