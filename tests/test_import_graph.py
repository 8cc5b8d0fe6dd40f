"""The package's import graph keeps its layers: kernels -> models -> engine -> pipeline -> shared ->
launch | stages -> api / bench / cli; nothing imports a layer above its own, nothing imports itself in a circle,
the launcher (omni_triton/launch/) and the code that runs inside the stage stubs (omni_triton/stages/) meet only
in omni_triton/shared/, and build_engines depends on omni_triton, never the reverse.

The graph is read from the source with ``ast`` (static imports, function-level ones too), so a test run imports
none of it. The last test feeds the same checks a small tree with one violation of each kind.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("omni_triton", "build_engines")

# Lowest first; a module belongs to the layer of its longest matching prefix and may import its own layer and
# those below it. Same-rank layers may import each other (cycles aside), except the pairs in APART.
LAYERS = {
    # leaf helpers any layer uses (tracing, error tags, progress lines); they import nothing of the package
    "omni_triton": 0, "omni_triton.trace": 0, "omni_triton.error_tags": 0, "omni_triton.graph_buckets": 0,
    "omni_triton.warmup_progress": 0, "omni_triton.stage_profile": 0, "omni_triton.load_timeline": 0,
    "omni_triton.kernels": 1,
    "omni_triton.models": 2,
    "omni_triton.engine": 3,
    "omni_triton.pipeline": 4,
    # what both sides of the process boundary use: the settings object, placement, the stub process table
    "omni_triton.shared": 5,
    # checkpoint builders (tiny test checkpoint, dummy checkpoints of a config) the launcher and tests use
    "omni_triton.checkpoints": 5,
    "omni_triton.launch": 6,
    "omni_triton.stages": 6,
    "omni_triton.api": 7, "omni_triton.bench": 7, "omni_triton.cli": 7, "omni_triton.client": 7,
    "build_engines": 8,
}
APART = (("omni_triton.launch", "omni_triton.stages"),)
# The Triton model files run inside the stage stubs: never the launcher's code.
STUB_FORBIDDEN = ("omni_triton.launch", "omni_triton.api", "omni_triton.bench", "omni_triton.cli", "build_engines")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name an import statement in ``path`` may load (``from a import b``: ``a`` and ``a.b``)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per dot after the first
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's __init__ counts as the package)."""
    modules = module_files(root, packages)
    graph = {}
    for module, path in modules.items():
        targets = {_resolve(name, modules) for name in imported_names(path, module)}
        graph[module] = {target for target in targets if target and target != module}
    return graph


def layer_of(module: str, layers=LAYERS) -> str | None:
    matches = [prefix for prefix in layers if module == prefix or module.startswith(prefix + ".")]
    # the package root's own layer is for its __init__ only, not for every module under it
    matches = [prefix for prefix in matches if prefix != "omni_triton" or module == "omni_triton"]
    return max(matches, key=len) if matches else None


def unplaced(graph, layers=LAYERS) -> list[str]:
    return sorted(module for module in graph if layer_of(module, layers) is None)


def upward_imports(graph, layers=LAYERS) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module, layers)
        for target in sorted(targets):
            other = layer_of(target, layers)
            if own and other and layers[other] > layers[own]:
                found.append(f"{module} ({own}) -> {target} ({other})")
    return found


def crossings(graph, apart=APART, layers=LAYERS) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            pair = {layer_of(module, layers), layer_of(target, layers)}
            if any(pair == set(sides) for sides in apart):
                found.append(f"{module} -> {target}")
    return found


def back_into(graph, lower: str = "omni_triton", upper: str = "build_engines") -> list[str]:
    return [f"{module} -> {target}" for module, targets in sorted(graph.items())
            if module.split(".")[0] == lower for target in sorted(targets) if target.split(".")[0] == upper]


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    counter, index, low, stack, on_stack, found = itertools.count(), {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_every_module_has_a_layer(graph):
    assert unplaced(graph) == []


def test_no_upward_import(graph):
    assert upward_imports(graph) == []


def test_no_import_circle(graph):
    assert cycles(graph) == []


def test_launcher_and_stages_meet_only_in_shared(graph):
    assert crossings(graph) == []


def test_build_engines_is_never_imported_by_the_package(graph):
    assert back_into(graph) == []


def test_model_files_import_no_launcher_code():
    modules = module_files(ROOT)
    found = []
    for path in sorted((ROOT / "model_repository").glob("*/1/model.py")):
        for name in sorted(imported_names(path, "model")):
            target = _resolve(name, modules)
            if target and layer_of(target) in STUB_FORBIDDEN:
                found.append(f"{path.relative_to(ROOT)} -> {target}")
    assert found == []


def test_the_checks_catch_each_kind_of_violation(tmp_path):
    def write(relative: str, text: str = "") -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for package in ("omni_triton", "omni_triton/kernels", "omni_triton/models", "omni_triton/launch",
                    "omni_triton/stages", "omni_triton/shared", "build_engines"):
        write(f"{package}/__init__.py")
    write("omni_triton/kernels/tune.py", "def dims():\n    from omni_triton.models.config import Config\n")
    write("omni_triton/models/config.py")
    write("omni_triton/launch/render.py", "from omni_triton.stages import io\nfrom ..shared import settings\n")
    write("omni_triton/stages/io.py", "from omni_triton.shared.settings import Settings\n")
    write("omni_triton/shared/settings.py")
    write("omni_triton/models/a.py", "from . import b\n")
    write("omni_triton/models/b.py", "import omni_triton.models.a\n")
    write("omni_triton/launch/checkpoint.py", "from build_engines.tiny import build\n")
    write("build_engines/tiny.py", "from omni_triton.models import config\n")
    write("omni_triton/orphan.py")
    graph = import_graph(tmp_path)

    assert unplaced(graph) == ["omni_triton.orphan"]
    assert upward_imports(graph) == [
        "omni_triton.kernels.tune (omni_triton.kernels) -> omni_triton.models.config (omni_triton.models)",
        "omni_triton.launch.checkpoint (omni_triton.launch) -> build_engines.tiny (build_engines)"]
    assert cycles(graph) == [["omni_triton.models.a", "omni_triton.models.b"]]
    # the package's __init__ runs too
    assert crossings(graph) == ["omni_triton.launch.render -> omni_triton.stages",
                                "omni_triton.launch.render -> omni_triton.stages.io"]
    assert back_into(graph) == ["omni_triton.launch.checkpoint -> build_engines.tiny"]
