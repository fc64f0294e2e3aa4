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
        bad = _imported_modules(path) & {"prefect", "flows", "tasks"}
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def test_tasks_do_not_import_flows():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tasks").rglob("*.py") if "flows" in _imported_modules(p)]
    assert offenders == []
