"""docs/architecture.md's rules, read off the source: imports point down the pipeline, and nothing below the CLI
knows about it. Read with ``ast`` (nothing is imported), so a new import that breaks a rule fails here by name."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "calibrate"
# The stages in pipeline order (docs/architecture.md): vllm_facts/ (what vLLM serves, refuses and reads) below the
# checkpoint stage that writes by it; engine/ runs vLLM for the checkpoint's load audit and for verify.
STAGES = ("data", "model", "capture", "scales", "vllm_facts", "checkpoint", "engine", "verification")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The calibrate modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks left out), absolute names."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for stmt in node.body for n in ast.walk(stmt)}
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names]
            found |= {n for n in names if (PACKAGE.parent / Path(*n.split("."))).with_suffix(".py").is_file()} or {target}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name.split(".")[0] == "calibrate"}


def stage(name: str) -> int | None:
    parts = name.split(".")
    return STAGES.index(parts[1]) if len(parts) > 2 and parts[1] in STAGES else None


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_rules_see_the_imports_they_judge():
    """The reader itself: a known import of each kind is found (a rule over nothing found would pass for nothing)."""
    assert "calibrate.model.directory" in imports(PACKAGE / "checkpoint" / "loaders.py")  # relative, two dots
    assert "calibrate.checkpoint.write" in imports(PACKAGE / "api.py")  # relative, one dot, from a top-level module
    assert "calibrate.config" not in imports(PACKAGE / "capture" / "checks.py")  # only under TYPE_CHECKING there


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_stage_imports_only_the_stages_before_it(path):
    here = stage(module_name(path))
    if here is None:
        return
    later = sorted(t for t in imports(path) if (s := stage(t)) is not None and s > here)
    assert not later, f"{module_name(path)} ({STAGES[here]}) imports a later stage: {later}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_below_the_cli_imports_it(path):
    if module_name(path) in ("calibrate.cli", "calibrate.__main__"):
        return
    assert "calibrate.cli" not in imports(path), f"{module_name(path)} imports the CLI"


def lowest_importer(path: Path) -> int | None:
    """The earliest stage that imports the module at ``path`` (None: no stage does)."""
    users = [s for p in MODULES if (s := stage(module_name(p))) is not None and module_name(path) in imports(p)]
    return min(users, default=None)


# Modules beside the stages that some stage imports (choices, files, fp8, thresholds...).
BESIDE = [p for p in MODULES if p.parent == PACKAGE and lowest_importer(p) is not None]


def test_the_modules_beside_the_stages_are_found():
    assert {"choices.py", "thresholds.py", "fp8.py"} <= {p.name for p in BESIDE}


@pytest.mark.parametrize("path", BESIDE, ids=lambda p: p.name)
def test_a_top_level_module_a_stage_imports_imports_no_later_stage(path):
    """Such a module sits below the earliest stage that imports it: importing a later one would point that stage's
    import up by way of it."""
    lowest = lowest_importer(path)
    later = sorted(t for t in imports(path) if (s := stage(t)) is not None and s > lowest)
    assert not later, f"{module_name(path)}, which the {STAGES[lowest]} stage imports, imports a later stage: {later}"
