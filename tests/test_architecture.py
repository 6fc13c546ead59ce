"""docs/architecture.md's rules, read off the source: imports point down the pipeline, and nothing below the CLI
knows about it. Read with ``ast`` (nothing is imported), so a new import that breaks a rule fails here by name."""

import ast
import importlib
import re
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "calibrate"
# The stages in pipeline order (docs/architecture.md): vllm_facts/ (what vLLM serves, refuses, reads and maps) at the
# bottom, facts only, for every stage that reads a checkpoint or writes one by them; engine/ runs vLLM for the
# checkpoint's load audit and for verify.
STAGES = ("vllm_facts", "data", "model", "capture", "scales", "checkpoint", "engine", "verification")


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


def test_vllm_facts_is_torch_free():
    """The room of vLLM's facts imports without torch (the CLI's help, recipes and inspect's table read it)."""
    import subprocess
    import sys

    code = ("import sys, calibrate.vllm_facts.caveats, calibrate.vllm_facts.loaders, calibrate.vllm_facts.platforms, "
            "calibrate.vllm_facts.serving, calibrate.vllm_facts.release; print('torch' in sys.modules)")
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, check=True)
    assert answer.stdout.strip() == "False"


# ---- docs/architecture.md's "Where to add" lists, kept true ------------------------------------------------------

DOC = PACKAGE.parent / "docs" / "architecture.md"
_HEADING = re.compile(r"^### (.+?) \(keyed on `(\w+)\.(\w+)`(?:, rows by `(\w+)`)?\)$")
_ITEM = re.compile(r"^\d+\. `([^`]+)`(?: `(\w+)`)?( \(keyed\))?")


class Step(NamedTuple):
    path: str  # relative to the repository
    table: str | None  # the module-level name the change goes into
    keyed: bool  # the table must hold every name of the list's key


def where_to_add() -> dict[str, tuple[str, str, str | None, list[Step]]]:
    """Each "### A new ..." list of the section: title → (key module, key name, row field, its steps)."""
    text = DOC.read_text().split("\n## Where to add", 1)[1].split("\n## ", 1)[0]
    lists: dict[str, tuple[str, str, str | None, list[Step]]] = {}
    title = None
    for line in text.splitlines():
        if heading := _HEADING.match(line):
            title = heading.group(1)
            lists[title] = (heading.group(2), heading.group(3), heading.group(4), [])
        elif title and (item := _ITEM.match(line)):
            lists[title][3].append(Step(item.group(1), item.group(2), bool(item.group(3))))
    return lists


def names_in(table, field: str | None) -> set[str]:
    """The names a table holds: a dict's keys (or its rows' ``field`` where its keys are of another kind, as
    PLATFORMS' class names), a sequence of names, or a sequence of rows' ``field``."""
    rows = list(table.values()) if isinstance(table, dict) else list(table)
    if isinstance(table, dict) and (field is None or not hasattr(rows[0], field)):
        return {str(k) for k in table}
    return {getattr(r, field) for r in rows} if field and rows and hasattr(rows[0], field) else {str(r) for r in rows}


def missing(table, key: tuple[str, ...], field: str | None) -> list[str]:
    """The names of ``key`` (a parameter's ``:P`` left off) that ``table`` lacks."""
    held = names_in(table, field)
    return [name for name in (k.partition(":")[0] for k in key) if name not in held]


def table_of(step: Step):
    module = importlib.import_module(".".join(Path(step.path).with_suffix("").parts))
    return getattr(module, step.table)


def test_where_to_add_has_the_three_lists():
    lists = where_to_add()
    assert set(lists) == {"A new cache dtype", "A new observer", "A new platform or target"}
    for title, (_, _, _, steps) in lists.items():
        assert len(steps) >= 3 and any(s.keyed for s in steps), title
        assert any(s.path.startswith("tests/") for s in steps) and any(s.path.startswith("docs/") for s in steps), title


@pytest.mark.parametrize("title", sorted(where_to_add()))
def test_each_file_and_table_a_list_names_exists(title):
    for step in where_to_add()[title][3]:
        path = PACKAGE.parent / step.path
        assert path.is_file(), f"{title}: {step.path} does not exist"
        if step.table:
            tree = ast.parse(path.read_text())
            defined = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                       for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
            assert step.table in defined, f"{title}: {step.path} defines no {step.table}"


@pytest.mark.parametrize("title", sorted(where_to_add()))
def test_each_keyed_table_holds_every_name_of_the_key(title):
    module, name, field, steps = where_to_add()[title]
    key = getattr(importlib.import_module(f"calibrate.{module}"), name)
    for step in (s for s in steps if s.keyed):
        assert missing(table_of(step), key, field) == [], f"{title}: {step.path} {step.table}"


def test_a_name_added_to_the_key_alone_is_found():
    """The check's reach: a cache dtype, an observer and a target added to their key and to no table are named."""
    for title, new in (("A new cache dtype", "fp6_e3m2"), ("A new observer", "median:P"), ("A new platform or target", "tpu")):
        module, name, field, steps = where_to_add()[title]
        key = (*getattr(importlib.import_module(f"calibrate.{module}"), name), new)
        for step in (s for s in steps if s.keyed):
            assert missing(table_of(step), key, field) == [new.partition(":")[0]], (title, step.table)


# ---- verify's steps (docs/architecture.md, "One verify") -----------------------------------------------------------

VERIFICATION = PACKAGE / "verification"
# What measures (numbers from the model, the emulation or the engine) and what judges those numbers (verdicts, the
# recommendation, the words around them). Every module of verification/ is one or the other, or a step, or shared.
MEASURE = ("passes", "depth", "drift", "token_kinds", "tails", "engine", "fa3", "needle", "kvdtypes", "capacity",
           "schemes", "emulation", "reference", "sample")
JUDGE = ("verdict", "judgment", "advice", "scale1", "verdict_table", "report", "report_md", "report_json", "card", "plots")


def test_measurement_never_imports_judgment():
    """A measured number does not depend on how it will be judged: the measuring modules import no judging one."""
    assert {p.stem for p in VERIFICATION.glob("*.py")} >= set(MEASURE) | set(JUDGE)
    for name in MEASURE:
        judged = sorted(t for t in imports(VERIFICATION / f"{name}.py") if t.split(".")[-1] in JUDGE)
        assert not judged, f"verification/{name}.py measures, and imports judgment: {judged}"


def test_run_py_holds_the_order_and_no_step_imports_it():
    """verify's steps live in their own modules; run.py keeps verify, run_verify and the result (about 250 lines)."""
    assert len((VERIFICATION / "run.py").read_text().splitlines()) <= 250
    users = sorted(module_name(p) for p in MODULES if "calibrate.verification.run" in imports(p))
    assert all(not u.startswith("calibrate.verification.") for u in users), users


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first circle in ``graph`` (module → the modules it imports), as the path around it; None: there is none."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done or name not in graph:
            return None
        for target in sorted(graph[name]):
            if found := visit(target, [*path, name]):
                return found
        done.add(name)
        return None

    return next((found for name in sorted(graph) if (found := visit(name, []))), None)


def test_no_circle_of_imports():
    """No module reaches itself through its run-time imports (a circle makes the import order decide what exists)."""
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one
    found = circle({module_name(p): {t for t in imports(p) if t != module_name(p)} for p in MODULES})
    assert found is None, f"a circle of imports: {' -> '.join(found)}"
