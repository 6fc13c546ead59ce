"""Files as kvcal writes them: modes that follow the umask, whoever writes the bytes."""

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def file_mode() -> int:
    """The mode a new file gets under the process umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the umask's mode: safetensors creates files 0600, which a server
    running as another user (a vLLM container, a shared model store) cannot read."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())
