"""The library layer never imports Prefect (flows/ and tasks/ orchestrate; twinkle_core is plain Python)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_twinkle_core_never_imports_prefect_or_the_orchestration_layers():
    offenders = {}
    for path in (ROOT / "twinkle_core").rglob("*.py"):
        bad = _imported_modules(path) & {"prefect", "flows", "tasks", "twinkle_service"}
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def test_the_training_service_sits_beside_the_flows():
    """twinkle_service is a layer above twinkle_core (an HTTP server and its model engine); only the flows'
    command line starts it, and it uses no Prefect task or flow."""
    offenders = {str(p.relative_to(ROOT)): bad for p in (ROOT / "twinkle_service").rglob("*.py")
                 if (bad := _imported_modules(p) & {"prefect", "flows", "tasks"})}
    assert offenders == {}


def test_tasks_do_not_import_flows():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tasks").rglob("*.py") if "flows" in _imported_modules(p)]
    assert offenders == []


# twinkle_core's layers, lowest first: a module imports from its own group or lower ones only.
# Names that do not exist yet are allowed; every existing top-level name must be placed.
LAYERS = [
    {"atomic", "hashing", "paths", "entry", "perf", "config", "launch", "errors"},
    {"hub", "families", "precision"},
    {"data"},
    {"parallel"},
    {"megatron"},
    {"convert"},
    {"objectives", "embedding", "rl"},
    {"models"},
    {"evaluate", "tracking"},
    {"train"},
]
_LAYER = {name: n for n, group in enumerate(LAYERS, start=1) for name in group}


def _top_level_names() -> set[str]:
    core = ROOT / "twinkle_core"
    packages = {p.parent.name for p in core.glob("*/__init__.py")}
    return packages | {p.stem for p in core.glob("*.py") if p.stem != "__init__"}


def _core_imports(path: Path) -> set[str]:
    """The top-level twinkle_core names `path` imports, anywhere in the file (relative imports resolved)."""
    package = ["twinkle_core", *path.relative_to(ROOT / "twinkle_core").parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            # `from twinkle_core import x` / `from .. import x`: the names are the modules
            modules = [module + [alias.name] for alias in node.names] if len(module) == 1 else [module]
        else:
            continue
        names |= {m[1] for m in modules if len(m) > 1 and m[0] == "twinkle_core"}
    return names


def test_every_twinkle_core_module_has_a_layer():
    assert sorted(_top_level_names() - _LAYER.keys()) == []


def test_twinkle_core_imports_only_from_its_own_or_lower_layers():
    offenders = []
    for path in sorted((ROOT / "twinkle_core").rglob("*.py")):
        parts = path.relative_to(ROOT / "twinkle_core").parts
        own = _LAYER.get(parts[0] if len(parts) > 1 else path.stem)
        if own is None:  # twinkle_core/__init__.py, or an unplaced name (see the test above)
            continue
        for name in sorted(_core_imports(path)):
            if _LAYER.get(name, 0) > own:
                offenders.append(f"{path.relative_to(ROOT)}: imports twinkle_core.{name} "
                                 f"(layer {_LAYER[name]}) from layer {own}")
    assert offenders == [], "\n".join(offenders)
