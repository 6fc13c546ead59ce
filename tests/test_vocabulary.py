"""One vocabulary: every output a person reads (the terminal's answer and its --verbose form, report.md, the model
card) names each scheme by its ``choices.scheme_label`` (what a user types to get it), never by kvcal's internal names
(scale1, tensor, head, token, max, mse), which stay in code and report.json's keys."""

import re
from types import SimpleNamespace

import pytest
from builders import REPORT_LAYERS, report_dict

from calibrate.choices import SCHEMES, scheme_label
from calibrate.verification.card import card_text
from calibrate.verification.report import verify_text
from calibrate.verification.report_md import verify_markdown
from calibrate.verification.verdict import recommend, serve_lines

INTERNAL = [name for name in SCHEMES if SCHEMES[name].label != name and name != "bf16"]  # scale1, tensor, head, ...
_NAME = "|".join(INTERNAL)
# Where a scheme's name stands in each output: a table cell, the start of a line or bullet, "(x)", "x vs", "skipped x",
# "depth, x:", "scheme x", "x has", a quoted 'x'. Prose such as "per tensor", "the max observer" is not a scheme name.
USED_AS_A_NAME = re.compile(
    rf"\|\s*({_NAME})\s*\||^\s*(?:- )?(?:\*\*)?({_NAME})\b(?!-)|\(({_NAME})\)|(?<!per )\b({_NAME}) (?:vs|has|is lower|is higher|measured)\b|"
    rf"(?:skipped|depth,|[Ss]cheme|than) ({_NAME})\b|'({_NAME})'|\bscale1\b", re.MULTILINE)


def every_scheme_report() -> dict:
    """builders' report with every scheme of choices.SCHEMES, recommended and serve lines computed from them."""
    rep = report_dict(needle=True)
    tensor = rep["schemes"]["tensor"]
    for i, (name, spec) in enumerate(SCHEMES.items()):
        r = rep["schemes"].setdefault(name, {**tensor, "kl": 0.004 + 0.001 * i})
        r.update(kv_dtype=spec.kv_dtype, granularity=spec.granularity, kl_per_sequence=[r["kl"]] * 2,
                 quantizes_query=r["mode"] == "static", servable=True,
                 drift={"steps": 16, "first_divergence_min": 16, "first_divergence_median": 16, "agreement": 1.0,
                        "first_divergence": [None, None], "identical": 1.0, "decode_kl": 0.001, "decode_kl_stderr": None,
                        "near_ties_followed": 0},
                 depth={"trend": {"verdict": None, "why": "too few records"}, "buckets": [], "packed": []})
    rep["schemes"]["bf16"]["drift"] = rep["schemes"]["bf16"]["depth"] = None
    held = {"granularity": "tensor", "notes": [], "serving": []}
    layers = [SimpleNamespace(sliding_window=None, layer_idx=i) for i in REPORT_LAYERS]
    rep["recommendation"], rep["serve_command"] = recommend(rep["schemes"], held, layers, rep["checkpoint"])
    rep["serve_lines"] = serve_lines(rep["schemes"], held, layers, rep["checkpoint"])
    rep["drift"] = {"steps": 16, "prompts": 2, "prompts_asked": 2, "prompt_len": 32, "prompt_source": "data", "near_tie_nats": 0.1}
    rep["depth"] = {"rule": "r"}
    rep["skipped"] = {"head": "no per-head scales"}
    return rep


PROVENANCE = {"scales": {"granularity": "tensor", "observer": "max", "fp8_format": "e4m3fn", "headroom": 1.0},
              "kvcal_version": "test", "tokens": 1024, "dtype": "bfloat16", "device": "cpu", "data": []}


@pytest.mark.parametrize("output", ["terminal", "verbose", "report.md", "card"])
def test_no_output_names_a_scheme_by_kvcals_internal_name(output):
    rep = every_scheme_report()
    text = {"terminal": lambda: verify_text(rep), "verbose": lambda: verify_text(rep, verbose=True),
            "report.md": lambda: verify_markdown(rep, {}),
            "card": lambda: card_text("out", PROVENANCE, rep, None)}[output]()
    text = re.sub(r"^\| granularity \|.*\n.*\n.*\n", "", text, flags=re.MULTILINE)  # the card's --granularity, not a scheme
    found = [m.group(0) for m in USED_AS_A_NAME.finditer(text)]
    assert found == [], found
    for name in rep["schemes"]:  # and every scheme is there by its label
        assert scheme_label(name) in text or output == "terminal" and name not in rep["schemes"], name
