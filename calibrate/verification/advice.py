"""verify's advice for the serving target: what its vLLM refuses, the choice and its serve line, every target's line,
the layers to keep unquantized, what the cache costs and frees, and whether scale 1.0 is enough.

Takes the judged results and returns them, with what the advice adds (refusals, bytes per token), in a new
``Advice``: made again from the same judgment (as when the serve line's engine run sends the advice back), it says
the same thing once.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.write import tensor_bytes
from ..engine.launch import installed_vllm_version
from ..model.layers import AttentionLayer, ModelSignature
from ..vllm_facts import serving
from ..vllm_facts.platforms import Emulation as Writer
from .capacity import LayerKV, per_token, plan
from .config import VerifyConfig
from .emulation import Emulated, other_writers
from .judgment import Judged
from .kvdtypes import DTYPES
from .passes import probe_skip_layers
from .reference import Reference, on_device
from .sample import Sample
from .scale1 import EQUAL, WORSE, scale1_answer
from .schemes import Mode
from .subject import Subject, checkpoint_name, served_model
from .verdict import choose, emulated_figures, recommend, serve_lines, skip_choice, target_refusals


@dataclass(frozen=True)
class Advice:
    """What the target is told: the results as advised (the judged ones with the target's refusals and each cache's
    bytes), the recommendation's lines and its serve line, every target's serve line, the layers to keep unquantized,
    what the cache costs and frees, whether scale 1.0 is enough (FP8, nvfp4), the vLLM release said."""

    results: dict[str, dict]
    recommendation: list[str]
    serve: str
    serve_lines: dict[str, dict]
    skip_probe: dict | None
    pays: dict | None
    scale1: dict | None
    scale1_nvfp4: dict | None
    vllm_version: str | None


def advise(config: VerifyConfig, subject: Subject, ref: Reference, sample: Sample, emulated: Emulated, judged: Judged,
           engine_result: dict | None, *, probe: bool = True, lead: Sequence[str] = ()) -> Advice:
    """The advice for ``config.target`` on ``judged`` (the engine's figures where it ran a scheme); the skip-layer
    probe runs unless not ``probe``; ``lead``: lines that come before the recommendation's (the engine's)."""
    results = {name: {**r, "reasons": list(r["reasons"])} for name, r in judged.results.items()}
    layers, sig, model_config = ref.layers, ref.sig, subject.described.config
    # The serving target's vLLM: a dtype it lacks or serves wrongly is marked so instead of a verdict, never chosen.
    shape = serving.model_shape(vars(sig))
    for name, why in target_refusals(results, config.target, **shape).items():
        results[name]["target_refusal"] = why.short
        results[name]["reasons"].append(f"{why.note} ({'measured' if why.evidence == 'measured' else 'read in the source'}, "
                                        f"{serving.build_name(config.target)})")
    choice = choose(results)
    skip_probe = None
    if probe and choice is not None and config.probe_layers and len(layers) > 1 and results[choice]["mode"] != Mode.REFERENCE:
        # One baseline: the emulation's all-quantized pass against its passes with a layer left unquantized, even where
        # the engine's figures chose the scheme (an engine/emulation gap is no layer's gain).
        on_device(ref)
        measured = probe_skip_layers(ref.model, layers, next(s for s in emulated.schemes if s.name == choice),
                                     emulated_figures(results)[choice], sample.sequences, config)
        skip_probe = {**measured, **skip_choice(measured["kl"], measured["measured"], len(layers))}
    for r in results.values():
        r["bytes_per_token"] = len(layers) * DTYPES[r["kv_dtype"]].bytes_per_token(sig.num_kv_heads, sig.head_dim, _value_dim(sig))
        r["bytes_vs_bf16"] = (DTYPES[r["kv_dtype"]].bytes_per_token(1, sig.head_dim, _value_dim(sig))
                              / DTYPES["auto"].bytes_per_token(1, sig.head_dim, _value_dim(sig)))
    kv_layers = _kv_layers(ref.model.config, layers, sig)
    pays = does_it_pay(config, kv_layers, subject.files, results, subject.described.context or config.data.seq_len)
    if skip_probe is not None:
        skip_probe["bytes_per_token"] = skip_cost(kv_layers, results[skip_probe["scheme"]]["kv_dtype"], skip_probe["skip"],
                                                  pays["context"])
    plain = serving.unquantized_dtype(model_config)  # auto, unless a kv_cache_scheme would make auto fp8
    scale1 = scale1_answer(results)
    nvfp4_scale1 = scale1_answer(results, "nvfp4")
    vllm_version = config.vllm_version or installed_vllm_version()  # the release the caveats are said for
    served = served_model(subject)  # the report's serve lines name no local path
    engine_target = engine_result["target"] if engine_result else None
    recommendation, serve = recommend(results, emulated.held, layers, checkpoint_name(config.checkpoint), skip_probe, pays,
                                      target=config.target, unquantized=plain,
                                      scale1=" ".join(a["text"] for a in (scale1, nvfp4_scale1) if a) or None,
                                      vllm_version=vllm_version, served=served, engine_target=engine_target,
                                      mla=bool(sig.latent_dim), model_type=model_config.get("model_type"),
                                      scale_one=bool(scale1) and scale1["outcome"] in (EQUAL, WORSE))
    # The engine's figures choose its own target's line; every other target's is the emulation's with that target's
    # writer (its static schemes' twins), said so.
    own = Writer(config.backend, config.dtype, bool(config.kv_only))
    emulation = {target: f"kvcal's emulation, {Writer(w.backend, config.dtype, w.kv_only).flags() if target in judged.others else own.flags()}"
                 for target, w in other_writers(config).items()}
    lines = serve_lines(results, emulated.held, layers, served, skip_probe, unquantized=plain, **shape,
                        engine_target=engine_target, emulation=emulation, others=judged.others)
    return Advice(results, [*lead, *recommendation], serve, lines, skip_probe, pays, scale1, nvfp4_scale1, vllm_version)


def does_it_pay(config: VerifyConfig, kv_layers: list[LayerKV], files: list[Path], results: dict, context: int) -> dict:
    """``capacity.plan`` for bf16 and every measured scheme's cache dtype at ``--max-model-len`` on ``--gpu``."""
    names = dict.fromkeys(["auto", *(r["kv_dtype"] for r in results.values())])
    result = plan(kv_layers, sum(tensor_bytes(f) for f in files), config.max_model_len or context, config.gpu,
                  {name: _bytes_of(name) for name in names}, tp=config.tp)
    return {**result, "gpu": config.gpu}


def skip_cost(kv_layers: list[LayerKV], dtype: str, skip: list[int], context: int) -> dict:
    """KV bytes per token at ``context`` with every layer in ``dtype``, and with the ``skip`` layers in bf16."""
    return {"all_quantized": per_token(kv_layers, _bytes_of(dtype), context),
            "with_skip": per_token(kv_layers, _bytes_of(dtype), context, skip=set(skip), bf16_bytes_of=_bytes_of("auto"))}


def _kv_layers(model_config, layers: list[AttentionLayer], sig: ModelSignature) -> list[LayerKV]:
    """The attention layers as ``capacity`` sizes them: vLLM's index, KV heads, head size, sliding window."""
    window = getattr(model_config.get_text_config(), "sliding_window", None)
    return [LayerKV(layer.layer_idx, sig.num_kv_heads, sig.head_dim, _value_dim(sig), window if layer.sliding_window else None)
            for layer in layers]


def _value_dim(sig: ModelSignature) -> int:
    """Width of a cached V head: MLA caches no V (the latent row serves both), other models one as wide as K."""
    return 0 if sig.latent_dim else sig.head_dim


def _bytes_of(name: str):
    """``capacity``'s bytes per token of a layer in cache dtype ``name``."""
    return lambda layer: DTYPES[name].bytes_per_token(layer.heads, layer.head_dim, layer.head_dim_v)
