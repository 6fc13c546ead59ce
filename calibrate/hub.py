"""Models named as on the Hugging Face Hub (``org/name``), fetched with huggingface_hub into its usual cache.

Two steps, so that a bad flag costs seconds, not a download: ``resolve`` fetches config.json alone (enough for a
recipe's fit and every cheap check) and pins the commit; ``fetch`` then brings the files a run reads, at that
commit, into the same snapshot directory. A local directory is used as it is. The snapshot path is
huggingface_hub's cache layout, ``.../models--ORG--NAME/snapshots/COMMIT``: ``fetch`` reads the model and commit
back from it, so the configuration carries one path, as for a local model.
"""

import re
from pathlib import Path

# What a run reads: configs, the tokenizer (and chat template), safetensors weights and their index; not .bin,
# .pth, GGUF, ONNX or "original/" copies of the weights. Modeling code only with --trust-remote-code.
# README.md: the source's model card, kept below kvcal's in OUT's (verification/card.py).
SMALL_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "README.md"]  # enough to open the data
NEEDED = SMALL_FILES + ["*.safetensors"]
REMOTE_CODE = ["*.py"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})")
# A snapshot's LFS files (the weights) are links into the repo's blobs/, each blob named by its content's sha256.
_LFS_BLOB = re.compile(r"[0-9a-f]{64}")


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub model id and is not a local path."""
    return not Path(name).exists() and _REPO_ID.fullmatch(name) is not None


def resolve(name: str, revision: str | None = None) -> str:
    """A local model directory for ``name``: itself when local, else the Hub snapshot holding its config.json.

    One short request asks the Hub which commit ``revision`` is (no retries: without a network it fails at
    once); unreachable, a copy already in the cache is used.

    Raises:
        ValueError: one line for a model or revision that does not exist, a gated model, no network and no
            cached copy, or ``revision`` given for a local directory.
    """
    if not is_repo_id(name):
        if revision is not None:
            raise ValueError(f"--revision picks a commit of a Hub model; {name} is a local path: drop --revision")
        return name
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    try:
        commit = HfApi().model_info(name, revision=revision, timeout=HUB_TIMEOUT_S).sha
    except HfHubHTTPError as e:  # the Hub answered: no such model or revision, gated...
        raise ValueError(_explain(e, name, revision)) from None
    except Exception:  # noqa: BLE001 — DNS, proxy, timeout, offline mode: the cache may still hold it
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
        if not isinstance(cached, str):
            raise ValueError(f"cannot reach the Hugging Face Hub for {name} and it is not in the local cache: connect "
                             "once, or pass a local model directory") from None
        return str(Path(cached).parent)
    try:
        return str(Path(hf_hub_download(name, "config.json", revision=commit)).parent)
    except Exception as e:  # noqa: BLE001 — every failure becomes one line that says what to do
        raise ValueError(_explain(e, name, revision)) from None


def snapshot_origin(model_dir: str | Path) -> dict | None:
    """``{"id": "org/name", "revision": commit}`` of a Hub snapshot directory (what ``resolve`` returns for a Hub
    model); None for any other path: a local directory's name says nothing about where its weights came from."""
    match = _SNAPSHOT.search(Path(model_dir).as_posix())
    return None if match is None else {"id": f"{match['org']}/{match['name']}", "revision": match["commit"]}


def repo_ref(text: str, flag: str, *, revision: bool = True) -> dict:
    """``org/name`` (or ``org/name@revision`` where ``revision``) as ``{"id", "revision"}``; the one-line refusal
    of anything else, in ``flag``'s words."""
    repo, _, rev = text.partition("@") if revision else (text, "", "")
    if _REPO_ID.fullmatch(repo) is None or (revision and "@" in text and not rev):
        form = "org/name or org/name@revision" if revision else "org/name"
        raise ValueError(f"{flag} {text!r}: write a Hugging Face Hub repo id, {form}")
    return {"id": repo, "revision": rev or None}


def check_card_names(base_model: str | None, hub_id: str | None) -> None:
    """Refuse a ``--base-model`` or ``--hub-id`` that is not a Hub repo id (the model card names both)."""
    if base_model is not None:
        repo_ref(base_model, "--base-model")
    if hub_id is not None:
        repo_ref(hub_id, "--hub-id", revision=False)


def base_model(model_dir: str | Path, given: str | None = None) -> dict | None:
    """The model the scales belong to, ``{"id", "revision"}``: ``given`` (``--base-model org/name[@revision]``; its
    revision read from ``model_dir``'s Hub snapshot when that is the same repo), else the Hub snapshot ``model_dir``
    is; None when unknown. Never config.json's ``_name_or_path``: it names whatever path the model was saved from."""
    origin = snapshot_origin(model_dir)
    if given is None:
        return origin
    ref = repo_ref(given, "--base-model")
    if ref["revision"] is None and origin is not None and origin["id"] == ref["id"]:
        ref["revision"] = origin["revision"]
    return ref


def snapshot_commit(model_dir: str | Path) -> str | None:
    """The commit of a Hub snapshot directory; None for any other path."""
    match = _SNAPSHOT.search(Path(model_dir).as_posix())
    return None if match is None else match["commit"]


def blob_sha256(path: str | Path) -> str | None:
    """The sha256 of a Hub snapshot's LFS file, read from the name of the blob it links to (no byte is read); None
    when ``path`` is no link into a ``blobs/`` folder or the blob is not named by a sha256 (git's own files are
    named by their sha1)."""
    path = Path(path)
    if not path.is_symlink():
        return None
    blob = path.resolve()
    return blob.name if blob.parent.name == "blobs" and _LFS_BLOB.fullmatch(blob.name) else None


def fetch(model_dir: str, *, trust_remote_code: bool = False, weights: bool = True, offline: bool | None = None) -> bool:
    """Bring the files a run reads into a Hub snapshot directory that ``resolve`` returned; a local model: nothing.

    ``weights=False`` brings the configs and the tokenizer alone (``SMALL_FILES``): enough to open the data, so
    that bad data fails before the weights download. Without a network (one short request tells, unless ``offline``
    says already), only the cache is read: a model cached whole still runs.

    Returns:
        Whether the Hub was out of reach: pass it as ``offline`` to a second call, which then asks no question.
    """
    match = _SNAPSHOT.search(Path(model_dir).as_posix())
    if match is None:
        return False
    from huggingface_hub import HfApi, snapshot_download

    repo, commit = f"{match['org']}/{match['name']}", match["commit"]
    if offline is None:
        try:
            HfApi().model_info(repo, revision=commit, timeout=HUB_TIMEOUT_S)
            offline = False
        except Exception:  # noqa: BLE001 — unreachable (or gone): what the cache holds is all there is
            offline = True
    try:
        snapshot_download(repo, revision=commit, local_files_only=offline,
                          allow_patterns=(NEEDED if weights else SMALL_FILES) + (REMOTE_CODE if trust_remote_code else []))
    except Exception as e:  # noqa: BLE001
        raise ValueError(_explain(e, repo, commit)) from None
    return offline


def _explain(error: Exception, name: str, revision: str | None) -> str:
    """What went wrong with a Hub request, and what to do, in one line."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, GatedRepoError):
        return f"{name} is gated on the Hugging Face Hub: accept its license there and log in (hf auth login)"
    if isinstance(error, RepositoryNotFoundError):
        return f"{name}: no such local directory, and no such model on the Hugging Face Hub (private? log in with hf auth login)"
    if isinstance(error, RevisionNotFoundError):
        return f"{name} has no revision {revision!r} on the Hugging Face Hub; name a branch, tag or commit it has"
    if isinstance(error, LocalEntryNotFoundError):
        return (f"cannot reach the Hugging Face Hub for {name} and it is not in the local cache: connect once, or pass "
                "a local model directory")
    if isinstance(error, EntryNotFoundError):
        return f"{name} on the Hugging Face Hub has no config.json: it is not a transformers model"
    return f"cannot fetch {name} from the Hugging Face Hub ({type(error).__name__}: {error}); retry, or pass a local directory"


HUB_TIMEOUT_S = 10.0
