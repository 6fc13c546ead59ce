"""Files as kvcal writes them: modes that follow the umask, whoever writes the bytes."""

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def current_umask() -> int:
    """The process umask, read from /proc where it can be: ``os.umask`` can only read by setting, racing threads."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``open``/``mkdir`` would have made."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for names, mode in ((dirnames, 0o777), (filenames, 0o666)):
            for name in names:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):  # a link's own mode means nothing; its target is not ours
                    os.chmod(path, mode & ~mask)


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in ``path``; not JSON, or JSON but not an object, is a one-line ValueError ending in ``fix``."""
    try:
        value = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object; {fix}")
    return value


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (data files and model files can be large)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_mode() -> int:
    """The mode a new file gets under the process umask (0644 under the usual 022)."""
    return 0o666 & ~current_umask()


def save_tensors(tensors: dict[str, "torch.Tensor"], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the umask's mode: safetensors creates files 0600, which a server
    running as another user (a vLLM container, a shared model store) cannot read."""
    from safetensors.torch import save_file  # here: data/stream.py hashes files through this module without torch

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` a temporary file beside ``path``, flush it to disk and rename it to ``path``: all or nothing. A reader
    sees the old file or the new, never half of one, and a link at ``path`` is replaced, never written through (its
    target may be a source's)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut too
    finally:
        os.close(fd)


def check_model_dir(model_dir: str | Path) -> None:
    """Refuse a model path that is a file or does not exist."""
    if Path(model_dir).is_file():
        raise ValueError(f"{model_dir} is a file; pass the model's directory (the one holding config.json)")
    if not Path(model_dir).is_dir():
        raise ValueError(f"model directory {model_dir} does not exist; pass a local Hugging Face model directory")


# The errors that mean "no room": the disk (or the user's quota) is full, or a file outgrew RLIMIT_FSIZE.
NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
           errno.EFBIG: "a file outgrew the file-size limit (ulimit -f)"}
_OS_ERROR = re.compile(r"os error (\d+)")  # how safetensors (Rust) reports an I/O error


def no_room(error: BaseException) -> str | None:
    """Why ``error`` is a disk that filled or a file-size limit hit (an OSError, or safetensors' error wrapping one),
    for a person; None for any other error."""
    code = getattr(error, "errno", None)
    if code is None and (m := _OS_ERROR.search(str(error))):
        code = int(m[1])
    return NO_ROOM.get(code)


def reserved_array(path: Path, shape: tuple[int, ...]) -> int:
    """A float32 ``.npy`` file of ``shape`` at ``path`` with its bytes reserved on disk first (a disk too small is an
    OSError here, which ``no_room`` words, not a SIGBUS at a later write into a sparse file); the offset of its data,
    for writes by position that map nothing into this process (a memory map's written pages count as its memory)."""
    import numpy as np  # here, not at the top: the CLI imports this module, and its help must not wait for numpy

    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
    offset = array.offset
    del array
    with open(path, "r+b") as f:
        os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    return offset
