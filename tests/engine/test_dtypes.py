"""engine/dtypes.py: the installed vLLM's cache dtypes against kvcal's, read from the real vLLM and from made-up lists."""

import ast
import subprocess

import pytest
from builders import LATER
from runners import client_python

from calibrate.choices import CACHE_DTYPES, VLLM_SCHEME_NAMES
from calibrate.engine.dtypes import NOT_EMULATED, EngineDtypes, engine_dtypes
from calibrate.vllm_facts.release import READ_IN


def literal_in_source(python) -> tuple[str, ...]:
    """vLLM's CacheDType read from its source file's text (no vLLM import): the independent reading."""
    path = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_"
                           "locations[0])"], capture_output=True, text=True, check=True, timeout=300).stdout.strip()
    tree = ast.parse(open(f"{path}/config/cache.py").read())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CacheDType"]
    return tuple(elt.value for elt in node.value.slice.elts)


@pytest.mark.slow
def test_the_installed_vllms_list_is_its_own():
    python = client_python("vLLM")
    found = engine_dtypes(python)
    assert found.names == literal_in_source(python)
    if found.vllm_version == READ_IN:  # the release kvcal's CACHE_DTYPES was read in: it lacks none of them
        assert found.missing(CACHE_DTYPES) == []
        assert set(found.not_emulated()) >= {"fp8_inc", "fp8_ds_mla", "turboquant_k8v4"}


@pytest.mark.smoke
def test_a_dtype_a_newer_vllm_adds_is_not_emulated_and_a_dropped_one_is_named():
    names = tuple(name for name in (*CACHE_DTYPES, "bfloat16", "octave_k3v4") if name != "nvfp4_4over6")
    rows = dict(EngineDtypes(LATER, names).rows())
    assert rows["octave_k3v4"] == NOT_EMULATED and rows["turboquant_k8v4"] == NOT_EMULATED
    assert rows["fp8"] == f"emulated as {VLLM_SCHEME_NAMES['fp8']}" and rows["int8_per_token_head"] == "emulated as int8_per_token_head"
    assert rows["nvfp4_4over6"] == f"not in vLLM {LATER}"
    assert EngineDtypes(LATER, names).missing(["fp8", "nvfp4_4over6"]) == ["nvfp4_4over6"]
