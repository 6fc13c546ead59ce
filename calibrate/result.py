"""What a calibrate, export or apply produced, and the summary a person reads after it (``kvcal calibrate`` prints it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .capture.stats import Stats
from .checkpoint.loaders import stored_dtype
from .choices import DEFAULT_TARGET
from .config import LITTLE_DATA_TOKENS
from .engine.launch import installed_vllm_version
from .model.directory import quant_config, read_config_json
from .model.layers import AttentionLayer
from .recipes import serve_notes
from .scales.at_one import at_one_line, at_scale_one
from .scales.observers import ScaleSet
from .scales.table import scale_table
from .vllm_facts import serving
from .vllm_facts.loaders import MLA_AT_ONE, quant_method

TOP_LAYERS = 5  # the per-layer rows calibrate's summary shows without --verbose

if TYPE_CHECKING:  # verification.run imports transformers (seconds); the result only holds its VerifyResult
    from .verification.run import VerifyResult


@dataclass
class CalibrationResult:
    """What a calibration or export produced."""

    out: Path
    layers: list[AttentionLayer]
    stats: Stats
    scale_set: ScaleSet
    provenance: dict
    verification: VerifyResult | None = None  # the short verify run after calibrate

    def summary(self, *, verbose: bool = False) -> str:
        """For a person: the layers that matter (every layer with ``verbose``), where OUT is, then the answer (the short
        verify's when it ran, else the written scales' serve line), the serve command last. ``verbose`` adds every note
        (predicted error, sink tokens, MLA, the output observer's choices, what the granularity needs, the recipe's)."""
        s = self.scale_set
        lines = [*self._layer_table(everything=verbose),
                 f"observer {s.observer}, granularity {s.granularity}, format {s.fmt.name}, "
                 f"{int(self.stats.tokens.max())} tokens per layer",
                 at_one_line(at_scale_one(self.stats, s.fmt), s.fmt)]
        if verbose:
            lines += [
                "predicted relative error (mean over layers): "
                + ", ".join(
                    f"{k} {s.granularity if s.granularity != 'token' else 'tensor'} {s.predictions[k].rel_mse.mean():.2e}"
                    f" / per-token {s.token_rel_mse[k].mean():.2e}"
                    for k in ("k", "v")
                ),
                *self._sink_note(), *self._latent_note(), *self._search_note(),
                *([serving.SERVE_NOTES[s.granularity]] if self.verification is not None else []),
                *self._release_note(), *self._recipe_notes(),
            ]
        lines.append(f"wrote {self.out}")
        # One answer per run, printed last: the short verify's when it ran, else the written scales'.
        if self.verification is not None:
            return "\n".join([*lines, "", "short verify of the written checkpoint (kvcal verify runs the full one):",
                              self.verification.summary(skip_layers=self._recipe_skip(), verbose=verbose,
                                                        risks=self._little_data())])
        return "\n".join([*lines, *self._written_serve_line(verbose=verbose)])

    def _layer_table(self, *, everything: bool) -> list[str]:
        """The per-layer table of absmax, scale and predicted saturation: every layer when ``everything`` or the model has
        few, else the TOP_LAYERS that matter most (the most saturated, then the largest absmax against the median
        layer's), in layer order, and a count of the rest."""
        s = self.scale_set
        absmax = {k: st.absmax if s.per_head else st.absmax.amax(1) for k, st in self.stats.kinds.items()}
        saturated = {k: p.saturated for k, p in s.predictions.items()}
        rows = list(range(len(self.layers)))
        if not everything and len(rows) > TOP_LAYERS + 1:
            worst_sat = torch.stack([saturated[k].reshape(len(rows), -1).amax(1) for k in saturated]).amax(0)
            outlier = torch.stack([(a := absmax[k].reshape(len(rows), -1).amax(1).double()) / a.median().clamp_min(1e-30)
                                   for k in absmax if k in s.scales]).amax(0)
            rows = sorted(sorted(rows, key=lambda i: (float(worst_sat[i]), float(outlier[i])), reverse=True)[:TOP_LAYERS])
        table = scale_table([self.layers[i].layer_idx for i in rows], {k: a[rows] for k, a in absmax.items()},
                            {k: v[rows] for k, v in s.scales.items()}, {k: v[rows] for k, v in saturated.items()})
        rest = len(self.layers) - len(rows)
        return [table, *([f"... {rest} more layers, less saturated and nearer the median absmax (--verbose shows them; "
                          "kvcal/calibration.json)"] if rest else []), ""]

    @property
    def target(self) -> str:
        """The serving target the run was for (outputs written before targets existed: the default)."""
        return self.provenance.get("settings", {}).get("target", DEFAULT_TARGET)

    def _recipe_skip(self) -> list:
        """The layers the recipe keeps in bf16 (``skip_layers``), added to the serve line."""
        return list((self.provenance.get("recipe") or {}).get("skip_layers", []))

    def _recipe_notes(self) -> list[str]:
        """The recipe's notes for the person serving the checkpoint (the skip layers go into the serve line)."""
        recipe = self.provenance.get("recipe")
        return serve_notes(recipe) if recipe else []

    def _written_serve_line(self, *, verbose: bool = False) -> list[str]:
        """The target and what the written granularity needs, then the serve line of the written scales on it, before
        any verify (nothing when the target does not read them as written); the sliding-window hint and the engine caveats for the installed vLLM come first
        (the first alone, with a count of the rest, unless ``verbose``), so the line is last."""
        shape = serving.model_shape(vars(self.stats.signature))
        written = serving.written_dtype(self.scale_set.granularity, self.target, **shape)
        if written is None:
            return [serving.target_text(self.target), serving.unserved(self.scale_set.granularity, self.target, **shape)]
        dtype, per_head = written
        hint = ([f"(this model has sliding-window layers; to keep them in bf16 add {serving.skip_flag([serving.SLIDING])})"]
                if any(layer.sliding_window for layer in self.layers) and serving.SLIDING not in map(str, self._recipe_skip()) else [])
        caveats = [f"note: {line}" for line in serving.caveats(self.target, dtype, vllm_version=installed_vllm_version(),
                                                                per_head=per_head, checkpoint_scales=True, mla=shape["mla"],
                                                                model_type=self.stats.signature.model_type)
                                                + serving.unrun(self.target, dtype)]
        notes = [*self._little_data(), *hint, *caveats]
        if not verbose and len(notes) > 1:
            notes = [f"{notes[0]} (+{len(notes) - 1} more with --verbose)"]
        return [serving.target_text(self.target), serving.SERVE_NOTES[self.scale_set.granularity], *notes, "serve it with:",
                f"  {serving.serve_command(str(self.out), dtype, target=self.target, per_head=per_head, skip_layers=self._recipe_skip())}"]

    def _release_note(self) -> list[str]:
        """For a ``quant_method: fp8`` release: what serving it needs, and the bf16 rounding vLLM applies to the scales."""
        if not (self.out / "config.json").is_file():  # a result whose OUT was moved or removed since: nothing to read
            return []
        config = read_config_json(self.out)
        method = quant_method(quant_config(self.out, config))
        if method != "fp8":
            return []
        rounded = stored_dtype(method, config)
        return ["quant_method fp8 release: its config was left as it is and declares no KV cache, so vLLM reads these "
                "scales only with --kv-cache-dtype fp8 (auto keeps a bf16 cache)"
                + (f"; vLLM stores them in {str(rounded).removeprefix('torch.')} (kvcal inspect shows the values used)"
                   if rounded is not None else "")]

    def _search_note(self) -> list[str]:
        """What the output observer chose, counted over layers, when it ran."""
        search = self.provenance.get("output_observer")
        if search is None:
            return []
        counts = {kind: ", ".join(f"{name} {search[kind]['chosen'].count(name)}" for name in search["candidates"]
                                  if name in search[kind]["chosen"]) for kind in ("k", "v")}
        return [f"output observer ({search['sequences']} held-back sequences), layers per candidate: "
                f"k: {counts['k']}; v: {counts['v']}"]

    def _sink_note(self) -> list[str]:
        """One line when the scales saturate the attention-sink tokens (the sink-aware observer accepts that)."""
        worst = {k: float(v.max()) for k, v in self.scale_set.sink_saturated.items() if float(v.max()) > 0}
        if not worst:
            return []
        return ["sink tokens (first positions) saturated, worst layer: "
                + ", ".join(f"{k} {100 * frac:.3g}%" for k, frac in worst.items())]

    def _latent_note(self) -> list[str]:
        """For MLA: the latent and k_pe under the one k scale, and what vLLM's scale of 1.0 (MLA_AT_ONE) does to them."""
        mla = self.provenance.get("mla")
        if mla is None:
            return []
        latent, pe = max(mla["latent_absmax"]), max(mla["k_pe_absmax"])
        clipped = sum(p > c for c, p in zip(mla["latent_absmax"], mla["k_pe_absmax"]))
        at_one = mla["saturated_at_scale_1"]
        return [f"MLA latent cache (kv_c_normed | k_pe under one k scale): absmax latent {latent:.4g}, k_pe {pe:.4g}; a "
                f"latent-only scale would saturate k_pe in {clipped} of {len(mla['k_pe_absmax'])} layers",
                f"{MLA_AT_ONE}: there k saturates {100 * max(at_one['k']):.3g}%, q "
                f"{100 * max(at_one['q']):.3g}% (worst layer; docs/vllm-notes.md, MLA)"]

    def _little_data(self) -> list[str]:
        """One line when the scales rest on fewer tokens than LITTLE_DATA_TOKENS, else none."""
        seen = int(self.stats.tokens.min())
        if seen >= LITTLE_DATA_TOKENS:
            return []
        return [f"scales rest on little data: {seen:,} tokens per layer (< {LITTLE_DATA_TOKENS:,}); rarer outliers "
                "were likely not seen: calibrate on more data (--max-tokens) or add --headroom before serving"]


@dataclass
class PackResult:
    """What ``export --pack`` wrote: PACK and its manifest (checkpoint/pack.py)."""

    pack: Path
    manifest: dict

    def summary(self) -> str:
        """What the pack is pinned to, and how to share it."""
        base, weights = self.manifest["base_model"], self.manifest["weights"]
        named = (f"{base['id']}" + (f" at revision {base['revision']}" if base["revision"] else " (revision unknown)")
                 if base["id"] else "a local model with no Hub id")
        return "\n".join([
            f"wrote {self.pack}: the scales alone, for {named}",
            f"pinned to {len(weights['sha256'])} weight file(s) by sha256 ({weights['from_hub_cache']} from the Hub cache's "
            f"blob names, {weights['computed']} read whole, {weights['sha256_seconds']:.1f} s)",
            f"share it with: hf upload ORG/REPO {self.pack}",
            f"serve it from a copy of the base model: kvcal apply {self.pack} MODEL --out OUT",
        ])


@dataclass
class AppliedPack:
    """What ``apply`` wrote from a pack: OUT, the model whose weights it links, the manifest, and the seconds the weights'
    sha256 took (None: not checked, ``other_weights``)."""

    out: Path
    model: Path
    manifest: dict
    check_seconds: float | None

    def summary(self) -> str:
        """Whether the weights are the pinned ones, and the serve line of the written scales."""
        checked = (f"its weights are the ones the pack pins (sha256 checked in {self.check_seconds:.1f} s)"
                   if self.check_seconds is not None else "its weights were not checked against the pack's (--other-weights)")
        scales = self.manifest["scales"]
        target = self.manifest.get("target") or DEFAULT_TARGET
        shape = serving.model_shape(scales["signature"])
        written = serving.written_dtype(scales["granularity"], target, **shape)
        serve = (["serve it with:", f"  {serving.serve_command(str(self.out), written[0], target=target, per_head=written[1])}"]
                 if written else [serving.unserved(scales["granularity"], target, **shape)])
        return "\n".join([f"wrote {self.out}: the pack's scales beside {self.model}'s weights, linked; {checked}", *serve])
