"""Recipes: named, validated YAML files holding the calibration settings that suit one model family.

A recipe says which models it fits, what data and sequence settings to use, how statistics become
scales, which layers the server should keep in bf16, which checkpoint form to write and what the
verification pass should compare. ``extends:`` builds on another recipe (sections merge key by key,
lists are replaced); command-line flags the user actually typed override recipe values. The recipe
that was used, resolved after both, is saved as ``recipe`` in ``kvcal/calibration.json``; saved to a
.json file on its own it is a valid recipe again, so a run can be repeated exactly.

The shipped recipes live in the repository's ``recipes/`` directory and, in an installed wheel, in
the package directory ``calibrate/recipe_files`` (pyproject maps one onto the other).
"""

import copy
import difflib
import json
import warnings
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import yaml

from . import hub
from .choices import check_form_name, check_verify_schemes, check_weights
from .config import CalibrationConfig, ScaleConfig
from .data.config import DataConfig
from .thresholds import Thresholds
from .vllm_facts import serving

DEFAULT_RECIPE = "default"
# Where shipped recipes are found: a source checkout first, then the installed package's data.
_CHECKOUT_DIR = Path(__file__).resolve().parent.parent / "recipes"
_PACKAGE_DIR = Path(__file__).resolve().parent / "recipe_files"

# The type names of the schema, by the annotation of the config field a key sets.
_KINDS = {str: "str", str | None: "str?", int: "int", float: "float", float | None: "float?", bool: "bool", list[str]: "list[str]"}


def _section(part: type) -> dict[str, str]:
    """A recipe section that fills one config part, key for key: its fields and their types."""
    return {f.name: _KINDS[f.type] for f in fields(part)}


# Every key a recipe may hold and the type of its value; a nested dict is a section of keys.
# "str?" and "float?" may also be null; "list[str|int]" holds strings or integers. The data, scales and
# verify.thresholds sections are the config parts they fill (config.py), so a setting is declared once.
SCHEMA: dict = {
    "name": "str",
    "description": "str",
    "extends": "str",
    "notes": "list[str]",  # reasoning and caveats shown to the user when the recipe is used
    "fits": {"model_types": "list[str]", "architectures": "list[str]"},  # empty: any model
    "data": _section(DataConfig),  # sources as --data; relative paths are relative to the working directory
    "scales": _section(ScaleConfig),
    "skip_layers": "list[str|int]",  # for vLLM's --kv-cache-dtype-skip-layers: "sliding_window" or layer indices
    "export": {"form": "str", "weights": "str?"},  # weights: null (untouched) or fp8 (needs llm-compressor)
    "verify": {"enabled": "bool", "schemes": "list[str]?", "thresholds": _section(Thresholds)},  # null: config's default
}

_TYPE_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "str?": lambda v: v is None or isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "float?": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": lambda v: isinstance(v, bool),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "list[str]?": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "list[str|int]": lambda v: isinstance(v, list) and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v),
}

# Recipe keys outside the part sections → the CalibrationConfig field each sets.
RUN_FIELDS = {
    ("export", "form"): "form",
    ("export", "weights"): "weights",
    ("verify", "enabled"): "verify",
    ("verify", "schemes"): "verify_schemes",
}


def recipe_paths() -> dict[str, tuple[str, ...]]:
    """Flat option name (``calibrate()`` keyword, CLI flag) → where a recipe holds it: every setting a recipe holds."""
    paths = {f.name: ("data", f.name) for f in fields(DataConfig)}
    paths["data"] = paths.pop("sources")  # --data: the sources
    paths |= {f.name: ("scales", f.name) for f in fields(ScaleConfig)}
    paths |= {f.name: ("verify", "thresholds", f.name) for f in fields(Thresholds)}
    return paths | {field: path for path, field in RUN_FIELDS.items()}


def recipe_dirs() -> list[Path]:
    """Directories holding shipped recipes: the checkout's ``recipes/`` if this is one, else package data."""
    checkout = _CHECKOUT_DIR.is_dir() and (_CHECKOUT_DIR.parent / "pyproject.toml").is_file()
    return [d for d in ([_CHECKOUT_DIR] if checkout else []) + [_PACKAGE_DIR] if d.is_dir()]


def shipped_recipes() -> dict[str, Path]:
    """Name → file of every shipped recipe (the first directory holding a name wins)."""
    found: dict[str, Path] = {}
    for directory in recipe_dirs():
        for path in sorted(directory.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def _locate(ref: str) -> Path:
    """A recipe reference (shipped name or file path) → its file."""
    path = Path(ref).expanduser()
    if path.suffix in (".yaml", ".yml", ".json") or "/" in ref:
        if not path.is_file():
            raise ValueError(f"recipe file {ref} does not exist; pass a recipe name ({', '.join(shipped_recipes())}) or a YAML file")
        return path
    shipped = shipped_recipes()
    if ref not in shipped:
        close = difflib.get_close_matches(ref, list(shipped), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"no recipe named {ref!r}; {hint}choose one of: {', '.join(shipped)} (kvcal recipes list), or pass a YAML file")
    return shipped[ref]


def _leaf_paths(schema: dict, prefix: str = "") -> dict[str, str]:
    """Key name → dotted path of every key in the schema, for suggestions."""
    paths = {}
    for key, kind in schema.items():
        paths.setdefault(key, prefix + key)
        if isinstance(kind, dict):
            paths.update({k: v for k, v in _leaf_paths(kind, f"{prefix}{key}.").items() if k not in paths})
    return paths


def _suggest(key: str, siblings: list[str]) -> str:
    """``; did you mean 'x'?`` for a misspelt or misplaced key, or nothing."""
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    elsewhere = _leaf_paths(SCHEMA)
    close = difflib.get_close_matches(key, list(elsewhere), n=1, cutoff=0.8)
    return f"; did you mean {elsewhere[close[0]]!r}?" if close else ""


def _check_shape(where: str, data, schema: dict, prefix: str = "") -> None:
    """Unknown keys and wrong types, each error naming the dotted key."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {prefix.rstrip('.') or 'the recipe'} must be a mapping of keys, got {type(data).__name__}")
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in schema:
            raise ValueError(f"{where}: unknown key {path!r}{_suggest(str(key), list(schema))}")
        kind = schema[key]
        if isinstance(kind, dict):
            _check_shape(where, value, kind, f"{path}.")
        elif not _TYPE_CHECKS[kind](value):
            raise ValueError(f"{where}: {path} must be {kind.replace('?', ' or null')}, got {value!r} ({type(value).__name__})")


def _check_values(where: str, recipe: dict) -> None:
    """Values the types alone do not catch, each checked by the config part or rule that owns it.

    Data and scale keys are checked one at a time (the part's defaults filling the rest), so that an error names its
    key; the thresholds only together, since their rule relates them.
    """

    def check(key: str, run: Callable[[], object]) -> None:
        try:
            run()
        except ValueError as e:
            raise ValueError(f"{where}: {key}: {e}") from None

    verify, export = recipe.get("verify", {}), recipe.get("export", {})
    for key, value in recipe.get("data", {}).items():
        check(f"data.{key}", DataConfig(**{"sources": [], key: value}).check_values)
    for key, value in recipe.get("scales", {}).items():
        check(f"scales.{key}", ScaleConfig(**{key: value}).validate)
    check("verify.thresholds", Thresholds(**verify.get("thresholds", {})).validate)
    check("export.form", lambda: check_form_name(export.get("form", "auto")))
    check("export.weights", lambda: check_weights(export.get("weights")))
    check("verify.schemes", lambda: check_verify_schemes(verify.get("schemes") or []))
    for item in recipe.get("skip_layers", []):
        if item != "sliding_window" and not (isinstance(item, int) and item >= 0):
            raise ValueError(f"{where}: skip_layers holds {item!r}; use 'sliding_window' or layer indices ≥ 0")


def _merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``: sections merge key by key, everything else is replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(SCHEMA.get(key), dict) and key in merged:
            merged[key] = {**merged[key], **copy.deepcopy(value)}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_recipe(ref: str, _seen: tuple[Path, ...] = ()) -> dict:
    """Read, validate and resolve a recipe (shipped name or file), following ``extends``.

    Returns:
        The resolved recipe: a plain dict holding only SCHEMA keys.

    Raises:
        ValueError: naming the file and the key, with the right spelling when one is close.
    """
    path = _locate(ref)
    where = f"recipe {path}"
    if path.resolve() in _seen:
        chain = " → ".join(str(p) for p in (*_seen, path.resolve()))
        raise ValueError(f"{where}: 'extends' makes a cycle ({chain}); make one recipe extend the other, not both")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)  # YAML's own message spans lines: its problem and where, in one
        problem = f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else " ".join(str(e).split())
        raise ValueError(f"{where} is not valid YAML (or JSON): {problem}") from None
    data = {} if data is None else data
    _check_shape(where, data, SCHEMA)
    _check_values(where, data)
    data.setdefault("name", path.stem)
    if "extends" not in data:
        return data
    parent_ref = data["extends"]
    if "/" in parent_ref and not Path(parent_ref).is_absolute():
        parent_ref = str(path.parent / parent_ref)  # a relative file path is relative to this recipe
    return _merge(load_recipe(parent_ref, (*_seen, path.resolve())), data)


def model_family(model_dir: str | Path) -> tuple[list[str], list[str]]:
    """(model types, architectures) from a checkpoint's config.json: the text model's type and, for a
    multimodal checkpoint, the top-level one too."""
    from .model.description import read_config_file
    from .model.directory import model_types

    config = read_config_file(model_dir)
    return model_types(config), config.get("architectures") or []


def check_fits(recipe: dict, model_dir: str | Path, *, force: bool = False) -> None:
    """Refuse a recipe written for another family, unless ``force`` (then only warn).

    A model fits when one of its model types or architectures is listed under ``fits``; a recipe
    without ``fits`` fits every model.
    """
    fits = recipe.get("fits", {})
    types, archs = fits.get("model_types", []), fits.get("architectures", [])
    if not types and not archs:
        return
    model_types, architectures = model_family(model_dir)
    if set(model_types) & set(types) or set(architectures) & set(archs):
        return
    message = (
        f"recipe {recipe['name']!r} is written for {', '.join(types + archs)}, but {model_dir} is a "
        f"{'/'.join(model_types) or 'model of unknown type'} ({', '.join(architectures) or 'no architectures'})"
    )
    if not force:
        raise ValueError(f"{message}; choose a recipe for this family (kvcal recipes list) or pass --force to use it anyway")
    warnings.warn(f"{message}; using it because of --force", stacklevel=2)


def apply_overrides(recipe: dict, overrides: dict) -> dict:
    """The recipe with settings given as flat options (``recipe_paths``) written into it.

    Args:
        recipe: a resolved recipe.
        overrides: option name → value, only for flags the user actually gave.
    """
    paths = recipe_paths()
    resolved = copy.deepcopy(recipe)
    for name, value in overrides.items():
        if name not in paths:
            raise ValueError(f"{name!r} is not a setting a recipe holds; recipe settings: {', '.join(sorted(paths))}")
        *sections, key = paths[name]
        node = resolved
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    return resolved


def config_parts(recipe: dict) -> dict:
    """A resolved recipe, section by section, as CalibrationConfig's parts and fields."""
    verify = recipe.get("verify", {})
    return {
        "data": DataConfig(**{"sources": [], **recipe.get("data", {})}),
        "scales": ScaleConfig(**recipe.get("scales", {})),
        "thresholds": Thresholds(**verify.get("thresholds", {})),
        **{field: recipe[section][key] for (section, key), field in RUN_FIELDS.items() if key in recipe.get(section, {})},
    }


def calibration_config(*, recipe: str | None, model: str, out: str, force: bool = False, **options) -> CalibrationConfig:
    """The validated CalibrationConfig of a run: recipe (default: ``default``) ← the options given.

    The one way a run is configured: ``kvcal calibrate`` passes its parsed flags, ``calibrate()`` its keywords.

    Args:
        recipe: shipped recipe name or YAML file; None uses the ``default`` recipe.
        model, out: as in CalibrationConfig.
        force: use a recipe written for another model family (with a warning).
        **options: flat settings; those a recipe holds (``recipe_paths``: ``data``, ``seq_len``, ``observer``...)
            override it, the others (``device``, ``max_memory``, ``resume``...: the machine's business) go to
            CalibrationConfig as they are. None values are ignored, so a CLI can pass its parsed flags as they are.

    Raises:
        ValueError: bad recipe, a recipe for another family without ``force``, an unknown option, or any check
            of the configuration tree.
    """
    given = {k: v for k, v in options.items() if v is not None}
    paths = recipe_paths()
    held = {k: v for k, v in given.items() if k in paths}
    machine = {k: v for k, v in given.items() if k not in paths}
    own = {f.name for f in fields(CalibrationConfig)} - {"model", "out", "recipe"} - set(CalibrationConfig.PARTS)
    unknown = sorted(set(machine) - own)
    if unknown:
        raise ValueError(f"unknown calibration option {unknown[0]!r}; options: {', '.join(sorted(own | set(paths)))}")
    resolved = apply_overrides(load_recipe(recipe or DEFAULT_RECIPE), held)
    model = hub.resolve(model, machine.get("revision"))  # a Hub id: its config.json, fetched into the Hub cache
    check_fits(resolved, model, force=force)
    return CalibrationConfig(model=model, out=out, recipe=resolved, **config_parts(resolved), **machine).validate()


def serve_notes(recipe: dict) -> list[str]:
    """What the recipe asks of the ``vllm serve`` command and of the user, one line each (its skip layers are in the
    serve line kvcal prints after them, ``serving.with_skip_layers``)."""
    lines = [f"recipe {recipe['name']}: {note}" for note in recipe.get("notes", [])]
    skip = recipe.get("skip_layers", [])
    if skip:
        lines.append(f"recipe {recipe['name']}: keep these layers in bf16 when serving ({serving.skip_flag(skip)}; "
                     "in the serve line below)")
    return lines


def describe(name: str) -> str:
    """``kvcal recipes show``: the recipe file as written (with its reasoning), then its resolved form."""
    path = _locate(name)
    resolved = load_recipe(name)
    return f"# {path}\n{path.read_text().rstrip()}\n\n# resolved (after extends):\n" + yaml.safe_dump(resolved, sort_keys=False)


def listing() -> str:
    """``kvcal recipes list``: one line per shipped recipe: name, what it fits, description."""
    rows = []
    for name in shipped_recipes():
        recipe = load_recipe(name)
        target = ", ".join(recipe.get("fits", {}).get("model_types", [])) or "any model"
        rows.append((name, target, recipe.get("description", "")))
    width = max(len(r[0]) for r in rows)
    twidth = max(len(r[1]) for r in rows)
    return "\n".join(f"{n:<{width}}  {t:<{twidth}}  {d}" for n, t, d in rows)
