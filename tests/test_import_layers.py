"""The package's structure: no import circle between its rooms (top-level packages and modules)
or between the modules of one room, nothing below the stages imports trainers/, and no module
longer than a reader can hold. Function-local imports count: they are circles deferred, not
removed. Read from the source (ast), so it takes no imports and no torch."""

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rlhf"
# What may import trainers/: the entry points above the stages.
ABOVE_STAGES = {"trainers", "pipeline", "__main__", "torchrun", "launch", "smoke"}
# A module longer than this is split by concern; one that must stay longer says why here.
MAX_MODULE_LINES = 500
LONGER_MODULES: dict[str, str] = {}


def module_imports() -> dict[str, set[str]]:
    """{module: the package's modules it imports, anywhere in its source}."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:  # megatron_rlhf.a.b.name -> the module that defines it
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    imports = {}
    for module, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        imports[module] = {m for n in names if n.startswith("megatron_rlhf") and (m := module_of(n)) not in (None, module)}
    return imports


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (a path back to its start), or [] when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as found:
        return found.args[1]
    return []


def test_circles_are_found():
    found = circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert found[0] == found[-1] and sorted(set(found)) == ["a", "b", "c"]
    assert circle({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_rooms_or_inside_one():
    imports = module_imports()
    between = {}
    for module, targets in imports.items():
        for target in targets:
            if room(module) and room(target) and room(module) != room(target):
                between.setdefault(room(module), set()).add(room(target))
    assert circle(between) == [], "rooms that import each other, directly or round about"
    for name in {room(m) for m in imports if room(m)}:
        # a package's __init__ re-exports its modules: only the modules' imports of each other count
        inside = {m: {t for t in targets if room(t) == name and t != f"megatron_rlhf.{name}"}
                  for m, targets in imports.items() if room(m) == name and m != f"megatron_rlhf.{name}"}
        assert circle(inside) == [], f"modules of {name}/ that import each other"


def test_nothing_below_the_stages_imports_trainers():
    climbs = [f"{m} -> {t}" for m, targets in sorted(module_imports().items()) for t in sorted(targets)
              if room(t) == "trainers" and room(m) not in ABOVE_STAGES]
    assert climbs == []


def test_no_module_is_longer_than_a_reader_can_hold():
    lengths = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
               for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES and name not in LONGER_MODULES} == {}
