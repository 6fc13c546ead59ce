"""choices.py: the one list of each name a user types, its refusals, and the check that tables keyed on it cover it."""

import pytest

from calibrate import choices
from calibrate.fp8 import FORMATS, WRITERS, get_format
from calibrate.scales.observers import parse_granularity, parse_observer
from calibrate.verification.kvdtypes import DTYPES


def test_the_tables_that_give_names_meaning_cover_exactly_the_names():
    assert tuple(FORMATS) == choices.FP8_FORMATS and tuple(DTYPES) == choices.CACHE_DTYPES
    assert tuple(WRITERS) == choices.BACKENDS
    # Every verify scheme that names a cache dtype is one kvcal emulates.
    cache_schemes = [name for name in choices.VERIFY_SCHEMES if name in DTYPES]
    assert cache_schemes and all(DTYPES[name].emulate is not None for name in cache_schemes)


@pytest.mark.parametrize("table", [{"a": 1}, {"a": 1, "b": 2, "c": 3}, {"b": 2, "a": 1}], ids=["missing", "extra", "reordered"])
def test_a_table_that_drifts_from_its_names_fails_at_import(table):
    with pytest.raises(RuntimeError, match="covers .* not choices'"):
        choices.check_table(table, ("a", "b"), "a table")
    choices.check_table({"a": 1, "b": 2}, ("a", "b"), "a table")  # exactly the names, in order: accepted


@pytest.mark.parametrize("text, message", [
    ("median", "unknown observer 'median'; choose one of: max, percentile:P, mse, sink-aware, output"),
    ("max:1", "unknown observer 'max:1'"),
    ("percentile:x", "write the percentile as a number"),
    ("percentile:0", "the percentile must be in (0, 100]"),
    ("percentile:100.5", "the percentile must be in (0, 100]"),
])
def test_an_unknown_observer_is_one_line_listing_the_choices(text, message):
    with pytest.raises(ValueError) as e:
        parse_observer(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_named_observer_parses_and_keeps_its_spelling():
    for text in ("max", "mse", "sink-aware", "output", "percentile:99.99", " mse "):
        assert str(parse_observer(text)) == text.strip()
    assert parse_observer("percentile:100").percentile == 100.0


def test_granularities_formats_schemes_and_forms_refuse_unknown_names_with_a_hint():
    for name in choices.GRANULARITIES:
        assert parse_granularity(name) == name
    with pytest.raises(ValueError, match="unknown granularity 'channel'; choose one of: tensor, head, token"):
        parse_granularity("channel")
    with pytest.raises(ValueError, match="unknown FP8 format 'e5m2'; choose one of: e4m3fn, e4m3fnuz"):
        get_format("e5m2")
    with pytest.raises(ValueError, match="unknown verify scheme 'nvfp5'; did you mean 'nvfp4'"):
        choices.check_verify_schemes(["tensor", "nvfp5"])
    with pytest.raises(ValueError, match="unknown export form 'modelop'; did you mean 'modelopt'"):
        choices.check_form_name("modelop")
    with pytest.raises(ValueError, match="--weights 'int4': choose fp8"):
        choices.check_weights("int4")
    choices.check_weights(None)
    with pytest.raises(ValueError, match="unknown backend 'rocm'; choose one of: cuda, triton, cpu"):
        choices.check_backend("rocm")
    for name in choices.BACKENDS:
        choices.check_backend(name)
