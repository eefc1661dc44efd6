"""The layering of docs/ARCHITECTURE.md: no import goes up, and the schedule IR stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron_chimera"

# Each module belongs to one layer; a layer may import itself and the layers listed for it.
# The package root holds only the base modules and parallel_state; everything else is a package.
BASE_MODULES = ("__init__", "config", "atomic", "layout", "errors")
ROOT_MODULES = BASE_MODULES + ("parallel_state",)
_BELOW_CHECKPOINT = {"base", "schedules", "parallel_state", "tensor_parallel", "model", "data",
                     "distributed", "optimizer"}
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "schedules": {"base"},
    "parallel_state": {"base"},
    # the parallelism layer: Megatron-core's tensor_parallel over parallel_state's groups
    "tensor_parallel": {"base", "parallel_state"},
    "model": {"base", "parallel_state", "tensor_parallel"},
    "data": {"base"},
    # gradient buffers and their reduction (Megatron-core's distributed/)
    "distributed": {"base", "model", "parallel_state", "tensor_parallel"},
    "optimizer": {"base", "model", "parallel_state", "tensor_parallel", "distributed"},
    "tuning": {"base", "schedules", "model"},
    "pipeline": {"base", "schedules", "parallel_state", "tensor_parallel", "model",
                 "distributed"},
    "checkpoint": _BELOW_CHECKPOINT,
    # the driver: the loop, arguments, initialisation, monitor
    "training": _BELOW_CHECKPOINT | {"tuning", "pipeline", "checkpoint"},
    # one-process inference, then Hugging Face interop on top of it: tools' library code
    "inference": {"base", "model", "data", "checkpoint"},
    "hf": {"base", "model", "data", "checkpoint", "inference"},
    # Megatron-LM checkpoints in and out (tools' library code; reuses import-hf's record)
    "megatron_lm": {"base", "model", "data", "checkpoint", "inference", "hf"},
}


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside the package."""
    parts = module.split(".")
    assert parts[0] == "megatron_chimera", module
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in BASE_MODULES:
        return "base"
    if top in ALLOWED:
        return top
    raise AssertionError(f"{module}: no layer assigned (add it to tests/unit/test_architecture.py "
                         f"and docs/ARCHITECTURE.md)")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    relative = path.relative_to(package.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def internal_imports(path: Path, package_root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, imported module) for every import of the package in ``path``, at any depth
    (function-level imports included), relative imports resolved."""
    module = module_name(path, package_root)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "megatron_chimera"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "megatron_chimera":
                continue
            if node.module is None or target == "megatron_chimera":
                # ``from . import x`` / ``from megatron_chimera import x``: x is a submodule
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def all_edges(package: Path = PACKAGE) -> list[tuple[str, int, str]]:
    return [(module_name(path, package), line, target)
            for path in sorted(package.rglob("*.py"))
            for line, target in internal_imports(path, package)]


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_no_import_goes_up():
    upward = []
    for source, line, target in all_edges():
        src, dst = layer_of(source), layer_of(target)
        if src != dst and dst not in ALLOWED[src]:
            upward.append(f"{source}:{line} ({src}) imports {target} ({dst})")
    assert not upward, "imports against docs/ARCHITECTURE.md:\n" + "\n".join(upward)


def test_the_walker_sees_relative_and_function_level_imports(tmp_path):
    """The check can fail: upward imports planted in a copy of the layout are found."""
    package = tmp_path / "megatron_chimera"
    (package / "schedules").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "schedules" / "__init__.py").write_text("from .probe import f\n")
    (package / "schedules" / "probe.py").write_text(
        "import json\n\n\ndef f():\n    from ..pipeline import executor\n"
        "    import megatron_chimera.training\n    return executor, json\n")
    edges = [(s, t) for s, _, t in all_edges(package)]
    assert edges == [("megatron_chimera.schedules", "megatron_chimera.schedules.probe"),
                     ("megatron_chimera.schedules.probe", "megatron_chimera.pipeline"),
                     ("megatron_chimera.schedules.probe", "megatron_chimera.training")]
    assert [layer_of(t) for _, t in edges[1:]] == ["pipeline", "training"]
    assert not {"pipeline", "training"} & ALLOWED["schedules"]


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name imported from a module resolves to that
    module; importing a package is importing its ``__init__``)."""
    modules = {module_name(path, package) for path in package.rglob("*.py")}

    def resolve(target: str) -> str:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for source, _, target in all_edges(package):
        target = resolve(target)
        if target != source:
            graph[source].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (each contains a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_circle():
    """No module reaches itself through imports (package re-exports included)."""
    cycles = import_cycles(module_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_circle_check_can_fail(tmp_path):
    """A circle planted in a copy of the layout (through a package's re-export) is found."""
    package = tmp_path / "megatron_chimera"
    (package / "pipeline").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pipeline" / "__init__.py").write_text("from .a import f\n")
    (package / "pipeline" / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (package / "pipeline" / "b.py").write_text("from megatron_chimera.pipeline import f\n")
    assert import_cycles(module_graph(package)) == [
        ["megatron_chimera.pipeline", "megatron_chimera.pipeline.a",
         "megatron_chimera.pipeline.b"]]


def test_the_layers_form_no_circle():
    """The table itself is a hierarchy: no two layers may import each other (directly or not)."""
    assert not import_cycles({layer: set(allowed) for layer, allowed in ALLOWED.items()})


def test_the_package_root_holds_only_the_base_modules():
    """Everything but the base modules and parallel_state lives in a package of its concern."""
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ROOT_MODULES)
    assert not loose, f"modules at the package root: {loose}"
    assert len(list(PACKAGE.glob("*.py"))) <= 6


@pytest.mark.timeout(120)
def test_schedule_ir_is_torch_free():
    """Building Chimera-ZB at D=16, N=64 (registry, generators, list scheduler, validator,
    simulator) never imports torch."""
    code = (
        "import sys\n"
        "from megatron_chimera.schedules import build_schedule\n"
        "from megatron_chimera.schedules.simulate import simulate\n"
        "from megatron_chimera.schedules.validate import validate\n"
        "s = build_schedule('chimera-zb', 16, 64)\n"
        "validate(s)\n"
        "assert simulate(s).makespan > 0\n"
        "import megatron_chimera.schedules.cli, megatron_chimera.schedules.compare\n"
        "import megatron_chimera.schedules.registry\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _add_argument_calls(path: Path) -> list[int]:
    """Lines of ``*.add_argument(...)`` calls in ``path``."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"]


# The training flags are declared on the config fields and gathered by one parser; the schedule
# registry declares its options; the tools' shared argument pieces (inference, model presets,
# schedule sizes and costs) build the tools' own small parsers.
FLAG_DECLARING_MODULES = {"training/argument_parser.py", "schedules/registry.py",
                          "config/flag.py", "inference/tool_support.py", "model/presets.py",
                          "schedules/cli.py"}


def test_flags_are_declared_only_where_flags_live():
    stray = [f"{path.relative_to(PACKAGE)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in FLAG_DECLARING_MODULES
             for line in _add_argument_calls(path)]
    assert not stray, f"declare a flag on its config field (config/flag.py), not here: {stray}"


def test_the_flag_home_check_can_fail(tmp_path):
    module = tmp_path / "stray.py"
    module.write_text("def f(parser):\n    parser.add_argument('--x')\n")
    assert _add_argument_calls(module) == [2]


# The driver stays readable: every function of training/ fits on a screen.
MAX_DRIVER_FUNCTION_LINES = 50


def long_functions(directory: Path, limit: int) -> list[str]:
    """``module:function (n lines)`` for every function (methods and nested ones included) of
    the modules directly in ``directory`` longer than ``limit`` lines."""
    found = []
    for path in sorted(directory.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.name}:{node.name} ({lines} lines)")
    return found


def test_no_driver_function_over_fifty_lines():
    long = long_functions(PACKAGE / "training", MAX_DRIVER_FUNCTION_LINES)
    assert not long, (f"functions of training/ over {MAX_DRIVER_FUNCTION_LINES} lines (split "
                      f"them into named steps):\n" + "\n".join(long))


def test_the_function_length_check_can_fail(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(50))
    (tmp_path / "probe.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}")
    assert long_functions(tmp_path, 50) == ["probe.py:long (51 lines)"]


def test_a_run_is_a_small_typed_record_and_load_mirrors_save():
    """``Run`` stays what a run is (the running schedule has its own owner) and is not patched
    after construction; ``load_checkpoint`` takes one record, as ``save_checkpoint`` does."""
    import dataclasses
    import inspect

    from megatron_chimera.checkpoint.loading import load_checkpoint
    from megatron_chimera.training.setup import Run

    fields = dataclasses.fields(Run)
    assert len(fields) <= 15, [f.name for f in fields]
    assert not [f.name for f in fields if f.type == "Any"]
    assert Run.__dataclass_params__.frozen
    assert list(inspect.signature(load_checkpoint).parameters) == [
        "root", "target", "rank", "world_size"]
