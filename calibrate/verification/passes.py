"""The forward passes of verify and what they tally: the reference pass (which also runs every scheme's
attention on each layer's own inputs), one pass per scheme, the skip-layer probe, and the per-scheme metrics."""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..capture.hooks import cached_latent, latent_view, prefill_chunks
from ..fp8 import SATURATION_SLACK, FP8Format
from ..model.layers import is_latent
from . import fa3
from .config import NEAR_TIE_NATS, SKIP_BASELINE, VerifyConfig
from .schemes import Scheme, absorbed_attention
from .significance import mean_stderr


class ApplyScheme:
    """Attention hook of a scheme's end-to-end pass: every layer quantized, then the model's own attention."""

    def __init__(self, scheme: Scheme, row_of: dict[int, int]):
        self.scheme, self.row_of = scheme, row_of

    def latent_transform(self, module, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA: the model decompresses K and V from the latent as the quantized cache would hold it."""
        return self.scheme.latent(self.row_of[module.layer_idx], kv_c, k_pe)

    def __call__(self, module, query, key, value, attention_mask, base_attention, **kwargs):
        row = self.row_of[module.layer_idx]
        if is_latent(module):  # K and V come from the quantized latent already (latent_transform)
            if not self.scheme.latent_query(row):
                return base_attention(module, query, key, value, attention_mask, **kwargs)
            kv_c, k_pe = cached_latent(module)
            return absorbed_attention(module, query, kv_c, k_pe, self.scheme.query_quantizer(row), attention_mask, base_attention, **kwargs)
        # The cache holds unquantized K/V, so quantizing past + new here equals quantizing each position once on write.
        q, k, v = self.scheme.apply(self.row_of[module.layer_idx], query, key, value)
        return base_attention(module, q, k, v, attention_mask, **kwargs)


@dataclass
class Tally:
    """Running sums of one scheme over the sample."""

    err_sq: torch.Tensor  # [L] float64, Σ‖o_scheme − o_ref‖² of each layer's attention output (its own inputs)
    counts: dict[str, torch.Tensor]  # kind → [L, 3] int64: saturated, underflowed (subnormal or zero), total
    seq_kl: list[float] = field(default_factory=list)  # per sequence: mean KL(ref ‖ scheme), nats/token
    seq_nll: list[float] = field(default_factory=list)  # per sequence: mean next-token NLL
    seq_top1: list[float] = field(default_factory=list)  # per sequence: top-1 agreement with the reference
    seconds: float = 0.0
    token_kl: torch.Tensor | None = None  # [sequences, positions] float32 KL(ref ‖ scheme) of every position, once measured
    token_top1: torch.Tensor | None = None  # [sequences, positions] bool, the scheme's top-1 is the reference's (False: padding)
    clear_flips: list[tuple[int, int]] = field(default_factory=list)  # per sequence: (top-1 changed, positions) where the
    # reference's top-1 leads by more than NEAR_TIE_NATS


class ReferenceProbe:
    """Hook of the reference pass: the model's own attention, plus every scheme's on the same inputs."""

    def __init__(self, schemes: list[Scheme], tallies: dict[str, Tally], row_of: dict[int, int], num_layers: int):
        self.schemes, self.tallies, self.row_of = schemes, tallies, row_of
        self.ref_sq = torch.zeros(num_layers, dtype=torch.float64)
        self.capture: dict[int, dict] = {}  # layer row → FA3 inputs, filled while ``fa3_rows`` is set
        self.fa3_rows: torch.Tensor | None = None  # absolute positions to capture for the FA3 model
        self.fa3_layers: set[int] = set()

    def __call__(self, module, query, key, value, attention_mask, base_attention, **kwargs):
        out = base_attention(module, query, key, value, attention_mask, **kwargs)
        row, S = self.row_of[module.layer_idx], query.shape[2]
        ref = out[0].float()  # [B, S, Hq, D]
        self.ref_sq[row] += ref.square().sum(dtype=torch.float64)
        latent = cached_latent(module) if is_latent(module) else None
        if latent is not None:  # MLA: the latent row is what is cached, K and V alike, and the absorbed query
            q_abs, cached = latent_view(module, query, *latent)
            new = {"q": q_abs, "k": cached[:, :, -S:], "v": cached[:, :, -S:]}
        else:
            new = {"q": query, "k": key[:, :, -S:], "v": value[:, :, -S:]}  # count each position once
        for scheme in self.schemes:
            if not scheme.kinds():
                continue
            tally = self.tallies[scheme.name]
            if latent is not None:
                o = scheme.latent_attention(row, module, query, *latent, attention_mask, base_attention, **kwargs)[0]
            else:
                o = base_attention(module, *scheme.apply(row, query, key, value), attention_mask, **kwargs)[0]
            tally.err_sq[row] += (o.float() - ref).square().sum(dtype=torch.float64)
            for kind in scheme.counted():
                tally.counts[kind][row] += range_counts(new[kind], scheme.scale(kind, row, new[kind]), scheme.fmt)
        if self.fa3_rows is not None and row in self.fa3_layers and latent is None:
            start = key.shape[2] - S
            local = self.fa3_rows - start  # [R] row index inside this chunk
            if (local >= 0).all() and (local < S).all():
                self.capture[row] = {
                    "q": query[0, :, local].double().cpu(),  # [Hq, R, D]
                    "k": key[0].double().cpu(), "v": value[0].double().cpu(),  # [Hkv, N, D]
                    "model_out": out[0][0, local].transpose(0, 1).double().cpu(),  # [Hq, R, D]
                    "scaling": kwargs.get("scaling") or module.head_dim**-0.5,
                    "window": kwargs.get("sliding_window"),
                    "softcap": kwargs.get("softcap"),
                }
        return out


@torch.no_grad()
def range_counts(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """[saturated, underflowed, total] counts (int64, CPU) of ``x / scale`` in ``fmt``.

    Saturated: beyond the largest finite value by more than float32 rounding of the scale (a
    per-token scale of amax / 448 puts the largest element at 448 up to one rounding). Underflowed:
    non-zero but below the smallest normal, so stored as a subnormal or zero.
    """
    a = (x.float() / scale).abs()
    saturated = (a > fmt.max * (1 + SATURATION_SLACK)).sum()
    underflow = ((a > 0) & (a < fmt.min_normal)).sum()
    return torch.stack([saturated, underflow, torch.tensor(a.numel(), device=a.device)]).cpu()


def token_kl(ref_logits: torch.Tensor, ref_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ scheme) of each position, [n] nats, from the reference's logits and probabilities [n, V] and the
    scheme's logits [n, V]."""
    # KL = Σ p·(lp_ref − lp) = log Σ p·exp(−d) with d = ref_logits − logits centred under p (KL ignores a constant
    # shift). Two logits of one position differ little, so d keeps float32's precision, and KL its own relative
    # precision even at 1e-8 nats, where Σ p·(lp_ref − lp) is all rounding (numbers near ln V subtracted). Centred
    # twice: the first centring's rounding of a shift between the two (raw logits' normalisers differ) would otherwise
    # stay in d, 2% of a 1e-3 KL at a shift of 0.5, 14% of a 4e-9 one unshifted; after the second, under 0.3% for
    # both, against float64 (tests/verification/test_passes.py). In place: one [n, V] temporary, where the
    # three-temporary form took 1.4x as long (the engine path computes this over every run's whole array).
    d = ref_logits - logits  # [n, V]
    d.sub_(torch.linalg.vecdot(ref_p, d)[:, None])
    d.sub_(torch.linalg.vecdot(ref_p, d)[:, None]).neg_().expm1_()
    return torch.log1p(torch.linalg.vecdot(ref_p, d)).clamp(min=0)  # [n]


def top1_margin(logprobs: torch.Tensor) -> torch.Tensor:
    """How far each position's top-1 log-probability leads the runner-up, [n] nats, from log-probabilities [n, V]."""
    top2 = logprobs.topk(2, dim=-1).values  # [n, 2]
    return top2[:, 0] - top2[:, 1]


def _positions_metrics(ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor], logits: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KL(ref ‖ scheme), NLL of ``targets`` and top-1 agreement, each [n].

    ``ref`` is the reference's (logits [n, V], probabilities [n, V], argmax [n]), computed once per chunk;
    ``logits`` [n, V] are the scheme's.
    """
    ref_logits, ref_p, ref_top = ref
    lp = torch.log_softmax(logits, -1)  # [n, V]
    nll = -lp.gather(-1, targets[:, None]).squeeze(-1)  # [n]
    agree = ref_top == lp.argmax(-1)  # [n]
    return token_kl(ref_logits, ref_p, logits), nll, agree


@torch.no_grad()
def measure(
    model, layers, schemes: list[Scheme], sequences: list[torch.Tensor], config: VerifyConfig, fa3_rows: torch.Tensor | None,
    keep: Callable[[int, int, int, torch.Tensor], None] | None = None, end_to_end_only: Sequence[str] = (),
) -> tuple[dict[str, Tally], ReferenceProbe, list[float], float]:
    """Reference pass and one end-to-end pass per scheme over every sequence, chunk by chunk.

    Each chunk runs through the reference and then every scheme, each with its own KV cache, so only
    one chunk's logits per run are held at a time. ``keep(sequence, first position, positions, log-probabilities
    [n, V])`` is handed the reference's log-probabilities chunk by chunk (the engine's runs are compared with them: the
    model does not compute them again). ``end_to_end_only``: schemes measured by their own pass alone, whose attention
    the reference pass does not also run layer by layer (no per-layer error or range counts: the other targets' twins,
    judged on KL and top-1 only).

    Returns:
        (tallies per scheme, the reference probe with its per-layer sums and FA3 capture,
        reference NLL per sequence, seconds spent in reference passes).
    """
    device = next(model.parameters()).device
    row_of = {layer.layer_idx: row for row, layer in enumerate(layers)}
    L = len(layers)
    tallies = {s.name: Tally(torch.zeros(L, dtype=torch.float64), {k: torch.zeros(L, 3, dtype=torch.int64) for k in s.counted()}) for s in schemes}
    probe = ReferenceProbe([s for s in schemes if s.name not in end_to_end_only], tallies, row_of, L)
    probe.fa3_layers = set(fa3.layer_rows(config.fa3_layers, [layer.layer_idx for layer in layers])) if fa3_rows is not None else set()
    ref_nll, ref_seconds = [], 0.0
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in tallies}  # per sequence, its per-token KL [n]
    top1_rows: dict[str, list[torch.Tensor]] = {name: [] for name in tallies}  # and its per-token top-1 agreement [n]
    for i, seq in enumerate(tqdm(sequences, desc="verifying", unit="seq", disable=not config.progress)):
        ids = seq.to(device)[None]  # [1, S]
        probe.fa3_rows = fa3_rows if i == 0 else None
        # One chunked prefill per run, each with its own cache and hook, advanced chunk by chunk in turn.
        chunk_len = config.data.chunk_len
        ref_run = prefill_chunks(model, ids, chunk_len, hook=probe, keep_from=0)
        runs = {s.name: prefill_chunks(model, ids, chunk_len, hook=ApplyScheme(s, row_of), keep_from=0) for s in schemes}
        sums = {name: [0.0, 0.0, 0.0] for name in tallies}
        kls: dict[str, list[torch.Tensor]] = {name: [] for name in tallies}  # per chunk, [n] each
        agrees: dict[str, list[torch.Tensor]] = {name: [] for name in tallies}
        flips = {name: [0, 0] for name in tallies}
        nll = 0.0
        for start in range(0, ids.shape[1] - 1, chunk_len):  # a last chunk of only the final token never runs
            targets = ids[0, start + 1 : start + 1 + chunk_len]  # [n] next tokens; the last position has none
            t0 = time.perf_counter()
            ref_logits = next(ref_run)[: len(targets)]  # [n, V]
            ref_lp = torch.log_softmax(ref_logits, -1)  # [n, V]
            ref = (ref_logits, ref_lp.exp(), ref_lp.argmax(-1))
            clear = top1_margin(ref_lp) > NEAR_TIE_NATS  # [n]
            nll -= ref_lp.gather(-1, targets[:, None]).sum(dtype=torch.float64).item()
            if keep is not None:
                keep(i, start, ids.shape[1] - 1, ref_lp)
            ref_seconds += time.perf_counter() - t0
            for scheme in schemes:
                t0 = time.perf_counter()
                with scheme.precision(device):
                    logits = next(runs[scheme.name])[: len(targets)]  # [n, V]
                tallies[scheme.name].seconds += time.perf_counter() - t0
                kl, scheme_nll, agree = _positions_metrics(ref, logits, targets)
                for j, value in enumerate((kl.sum(dtype=torch.float64), scheme_nll.sum(dtype=torch.float64), agree.sum())):
                    sums[scheme.name][j] += value.item()
                kls[scheme.name].append(kl.float().cpu())
                agrees[scheme.name].append(agree.cpu())
                flips[scheme.name][0] += (clear & ~agree).sum().item()
                flips[scheme.name][1] += clear.sum().item()
        n = ids.shape[1] - 1
        ref_nll.append(nll / n)
        for name, (kl, scheme_nll, agree) in sums.items():
            tallies[name].seq_kl.append(kl / n)
            tallies[name].seq_nll.append(scheme_nll / n)
            tallies[name].seq_top1.append(agree / n)
            tallies[name].clear_flips.append((flips[name][0], flips[name][1]))
            rows[name].append(torch.cat(kls[name]))  # [n]
            top1_rows[name].append(torch.cat(agrees[name]))  # [n]
    for name, tally in tallies.items():  # a shorter sequence's row is NaN past its end
        tally.token_kl = torch.nn.utils.rnn.pad_sequence(rows[name], batch_first=True, padding_value=math.nan)  # [sequences, positions]
        tally.token_top1 = torch.nn.utils.rnn.pad_sequence(top1_rows[name], batch_first=True, padding_value=False)
    return tallies, probe, ref_nll, ref_seconds


def scheme_result(scheme: Scheme, tally: Tally, ref_sq: torch.Tensor, ref_nll: list[float]) -> dict:
    """Every number of one scheme, as plain JSON-able values (its note and verdict are judgment's, once the floor is known)."""
    kl, kl_se = mean_stderr(tally.seq_kl)
    nll, ref_mean_nll = sum(tally.seq_nll) / len(tally.seq_nll), sum(ref_nll) / len(ref_nll)
    top1 = sum(tally.seq_top1) / len(tally.seq_top1)
    frac = {k: {"saturated": (c[:, 0] / c[:, 2].clamp(min=1)).tolist(), "underflow": (c[:, 1] / c[:, 2].clamp(min=1)).tolist()}
            for k, c in tally.counts.items()}
    result = {
        "mode": scheme.mode, "granularity": scheme.granularity, "source": scheme.source, "quantizes_query": scheme.quantize_query,
        "layer_rel_error": (tally.err_sq / ref_sq.clamp(min=1e-300)).sqrt().tolist() if scheme.kinds() else [0.0] * len(ref_sq),
        "fractions": frac,
        "kl": kl, "kl_stderr": kl_se, "kl_per_sequence": tally.seq_kl,
        "nll": nll, "ppl": math.exp(nll), "ppl_reference": math.exp(ref_mean_nll), "ppl_change": math.exp(nll - ref_mean_nll) - 1,
        "top1": top1, "seconds": tally.seconds,
        "scales": {k: v.tolist() for k, v in scheme.scales.items()},
    }
    return result


@torch.no_grad()
def probe_skip_layers(model, layers, scheme: Scheme, result: dict, sequences: list[torch.Tensor], config: VerifyConfig) -> dict:
    """What keeping each layer unquantized gains end to end, for ``scheme``: estimated for every layer, measured for some.

    The estimate is each layer's own attention-output error (``layer_rel_error``: the layer quantized alone on
    the reference's inputs). The ``probe_layers`` layers measured are the ones the estimate ranks highest, plus
    the median-ranked one as a control: one pass each with every other layer quantized, paired with the
    scheme's own pass over the same sequences. Which layers are worth keeping is judgment's (``verdict.skip_choice``).
    ``result`` must be the emulation's (``verdict.emulated_figures``): both sides of each gain are then one method's
    (``baseline``), never an engine's KL less an emulated one.
    """
    start = time.perf_counter()
    estimate = result["layer_rel_error"]
    ranked = sorted(range(len(layers)), key=lambda row: -estimate[row])
    rows = ranked[: config.probe_layers]
    if 2 <= config.probe_layers < len(ranked):  # the last one measured is the control
        rows = ranked[: config.probe_layers - 1] + [ranked[(config.probe_layers - 1 + len(ranked)) // 2]]
    variants = [replace(scheme, name=f"{scheme.name} skip {layers[row].layer_idx}", skip=frozenset({row})) for row in rows]
    tallies = measure(model, layers, variants, sequences, config, None)[0]
    measured = []
    for row, variant in zip(rows, variants):
        gain = [a - b for a, b in zip(result["kl_per_sequence"], tallies[variant.name].seq_kl)]
        mean, se = mean_stderr(gain)
        measured.append({"layer": layers[row].layer_idx, "row": row, "estimate": estimate[row],
                         "kl_without": sum(tallies[variant.name].seq_kl) / len(sequences), "gain": mean, "gain_stderr": se,
                         "sequences": len(gain)})
    return {"scheme": scheme.name, "baseline": SKIP_BASELINE, "kl": result["kl"], "estimate": estimate, "layers": [layer.layer_idx for layer in layers],
            "measured": measured, "seconds": time.perf_counter() - start}
