"""The tree keeps its architecture: a framework-free core, a thin Dagster shell, harnesses apart.

Read from the source with ``ast`` (every import, including ones inside functions), so a core
module that starts importing Dagster or the shell fails here, not in review. The rules are the
ones docs/design.md states under "Layout".
"""

import ast
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGE = ROOT / "email_platform"
#: The Dagster shell and the entry points that may use it.
SHELL = (
    "ops",
    "sensors",
    "assets",
    "resources",
    "jobs",
    "definitions",
    # The Dagster Component (defs.yaml) over the definitions.
    "component",
    "cli",
)
#: Harnesses: the fake provider and the one-machine runners (demo, local daemon).
HARNESSES = ("sandbox", "local")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _top(module: str) -> str:
    """``email_platform.sending.batch`` -> ``sending``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


MODULES = sorted(PACKAGE.rglob("*.py"))
CORE = [p for p in MODULES if _top(_module_name(p)) not in (*SHELL, *HARNESSES, "db", "")]


def test_the_layout_has_a_core_to_check() -> None:
    tops = {_top(_module_name(p)) for p in CORE}
    assert {"sending", "providers", "webhooks", "store", "publishing", "mail"} <= tops


@pytest.mark.parametrize("path", CORE, ids=lambda p: _module_name(p))
def test_the_core_imports_neither_dagster_nor_the_shell(path: Path) -> None:
    bad = sorted(
        name
        for name in _imports(path)
        if name == "dagster"
        or name.startswith("dagster.")
        or name.startswith("dagster_")
        or (name.startswith("email_platform.") and _top(name) in (*SHELL, *HARNESSES))
    )
    assert bad == [], f"{_module_name(path)} imports {bad}"


@pytest.mark.parametrize(("side", "other"), [("providers", "webhooks"), ("webhooks", "providers")])
def test_providers_and_webhooks_do_not_import_each_other(side: str, other: str) -> None:
    offenders = {
        _module_name(path): sorted(n for n in _imports(path) if _top(n) == other)
        for path in (PACKAGE / side).rglob("*.py")
    }
    assert {module: names for module, names in offenders.items() if names} == {}
