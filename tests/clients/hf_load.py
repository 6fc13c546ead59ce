"""Load a checkpoint with plain transformers, as a user would, and compare it with a reference checkpoint.

Usage (in any venv with transformers, compressed-tensors and safetensors; the test-suite runs it in the main venv
and in the llm-compressor venv, whose transformers 5.17 + compressed-tensors 0.19 apply a kv_cache_scheme):

    python tests/clients/hf_load.py CHECKPOINT_DIR REFERENCE_DIR TOKENS.safetensors OUT.json

TOKENS.safetensors holds `input_ids`, int64 [N, seq_len]. Both models are loaded with
`AutoModelForCausalLM.from_pretrained(dir, dtype=float32, output_loading_info=True)` and run on every row.

Writes OUT.json:
    {"transformers": str, "compressed_tensors": str or null,
     "loading_info": {"missing_keys": [...], "unexpected_keys": [...], "mismatched_keys": [...]},  # of CHECKPOINT
     "reference_loading_info": {...},
     "scales": {"model.layers.0.self_attn.k_scale": [...], ...},  # every k/v/q scale parameter CHECKPOINT's model holds
     "top1": f,             # fraction of positions where the two models' argmax agree
     "max_abs_logit_diff": f, "mean_kl": f}  # KL(reference ‖ checkpoint), nats per position
"""

import json
import sys
from importlib.metadata import PackageNotFoundError, version

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SCALE_SUFFIXES = ("k_scale", "v_scale", "q_scale")


def load(directory: str):
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    info = {key: sorted(str(k) for k in info.get(key) or []) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return model.eval(), info


def main(checkpoint: str, reference: str, tokens: str, out: str) -> None:
    ids = load_file(tokens)["input_ids"]  # [N, S]
    model, info = load(checkpoint)
    ref_model, ref_info = load(reference)
    scales = {
        name: tensor.detach().float().flatten().tolist()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if name.rsplit(".", 1)[-1] in SCALE_SUFFIXES
    }
    with torch.no_grad():
        got = torch.cat([model(row[None]).logits[0] for row in ids]).double()  # [N*S, V]
        ref = torch.cat([ref_model(row[None]).logits[0] for row in ids]).double()
    kl = (ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1))).sum(-1).mean()
    try:
        ct = version("compressed-tensors")
    except PackageNotFoundError:
        ct = None
    result = {
        "transformers": version("transformers"), "compressed_tensors": ct,
        "loading_info": info, "reference_loading_info": ref_info, "scales": scales,
        "top1": (got.argmax(-1) == ref.argmax(-1)).double().mean().item(),
        "max_abs_logit_diff": (got - ref).abs().max().item(), "mean_kl": kl.item(),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
