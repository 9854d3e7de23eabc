"""Model ids as users type them -> local paths, so that everything after ``EngineConfig.from_kwargs`` sees
a file or a directory on disk.

A path that exists always wins. Otherwise the id names a Hugging Face hub repository, fetched (or found in
the cache) by huggingface_hub, with its cache (``HF_HUB_CACHE``), ``HF_HUB_OFFLINE``, ``HF_TOKEN`` and
progress bars:
- ``org/name``: a repo of safetensors (config.json + ``*.safetensors`` + tokenizer files) -> its snapshot
  directory; a repo of GGUF files alone -> its Q4_K_M file (llama.cpp's default), or its only one;
- ``org/name:QUANT``: the repo's ``.gguf`` file whose name carries the tag QUANT, case-insensitive
  (llama.cpp's ``-hf org/name:Q4_K_M``);
- ``org/name/path/file.gguf``: that file.
``revision`` (a branch, tag or commit) applies to hub ids only. Every failure is one ``CheckpointError`` line
that says what to do.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from specserve.errors import CheckpointError

logger = logging.getLogger(__name__)

DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's choice when `-hf org/name` names no tag
# What an HF checkpoint needs from its repo's top level: config, weights, tokenizer, chat template.
HF_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?"  # a namespace or repo name (huggingface_hub's rules)
_HUB_ID = re.compile(rf"({_PART}/{_PART})(?::([\w.+-]+)|/([^:]+\.gguf))?", re.IGNORECASE)
# A quant tag in a GGUF file name: Q4_K_M, IQ4_XS, Q8_0, UD-Q4_K_XL, TQ1_0, F16, BF16, ...
_QUANT = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I|T)?Q\d+(?:_[A-Za-z0-9]+)*|BF16|F16|F32|FP16|FP32)(?![A-Za-z0-9])",
                    re.IGNORECASE)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")  # llama.cpp's split files: name-00001-of-00003.gguf
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubId:
    repo_id: str
    tag: str | None = None  # org/name:TAG
    filename: str | None = None  # org/name/path/file.gguf


def parse_hub_id(spec: str) -> HubId | None:
    """The hub id ``spec`` spells, or None where it can only be a local path (absolute, ``./``, ``~``, one
    segment, a repo name huggingface_hub would refuse)."""
    m = _HUB_ID.fullmatch(spec)
    if m is None or spec.startswith((".", "~")) or "--" in m[1] or ".." in m[1]:
        return None
    if m[2] is None and m[3] is None and m[1].lower().endswith(".gguf"):  # dir/file.gguf: a local file
        return None
    if m[3] is not None and (m[3].startswith("/") or ".." in m[3].split("/")):
        return None
    return HubId(m[1], m[2], m[3])


def resolve_model(spec: str | None, revision: str | None = None) -> str | None:
    """A local path for ``spec``: None stays None (the demo model), a path that exists is returned as given,
    a hub id is downloaded into (or found in) the Hugging Face cache at ``revision`` (default: main).

    NOTE: a spelling that can only be a local path is returned as given even when nothing is there: the
    loader's one line ("PATH: no such file or directory") reports it when the engine loads, and configs
    naming paths of another machine can still be built."""
    hub = None if spec is None or os.path.exists(os.path.expanduser(spec)) else parse_hub_id(spec)
    if spec is None or hub is None:
        if revision and spec is not None:
            logger.warning("%s is a local path: revision %s is ignored", spec, revision)
        return spec
    try:
        path = _fetch(hub, revision)
    except CheckpointError:
        raise
    except Exception as e:  # huggingface_hub's errors, its HTTP library's, OSError: one line each
        raise CheckpointError(_explain(e, spec, hub, revision)) from e
    logger.info("%s%s: %s", spec, f" (revision {revision})" if revision else "", path)
    return path


def cached_repo_of(path: str) -> str | None:
    """``org/name`` where ``path`` is (in) a snapshot of the hub cache
    (``.../models--org--name/snapshots/<commit>[/file]``), else None: a display name for a checkpoint."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1][len("models--"):].replace("--", "/")
    return None


def _fetch(hub: HubId, revision: str | None) -> str:
    import huggingface_hub as hf

    if hub.filename is not None:
        return hf.hf_hub_download(hub.repo_id, hub.filename, revision=revision)
    files = _repo_files(hub.repo_id, revision)
    top = [f for f in files if "/" not in f]
    if hub.tag is None and "config.json" in top and any(_is_weights(f) for f in top):
        patterns = HF_PATTERNS if any(f.endswith(".safetensors") for f in top) else [*HF_PATTERNS, "*.bin"]
        return hf.snapshot_download(hub.repo_id, revision=revision, allow_patterns=patterns,
                                    ignore_patterns=["*/*"])
    return hf.hf_hub_download(hub.repo_id, pick_gguf(hub, files, revision), revision=revision)


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or fnmatch(name, "pytorch_model*.bin")


def pick_gguf(hub: HubId, files: list[str], revision: str | None = None) -> str:
    """The file ``org/name[:TAG]`` means among a repo's ``files``: the .gguf whose name carries the tag (no
    tag: Q4_K_M, or the repo's only .gguf). mmproj files (vision projectors) are never picked."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and not os.path.basename(f).lower().startswith("mmproj"))
    where = f"{hub.repo_id}{f' (revision {revision})' if revision else ''}{_cached_note()}"
    if not ggufs:
        what = "no .gguf files" if hub.tag else "neither config.json with *.safetensors nor .gguf files"
        raise CheckpointError(f"{where} has {what}: specserve loads HF safetensors repos and GGUF files")
    if hub.tag is None and len(ggufs) == 1:
        return ggufs[0]
    tag = hub.tag or DEFAULT_GGUF_TAG
    tagged = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = [f for f in ggufs if tagged.search(_stem(f))]
    tags = ", ".join(sorted({_tag_of(f) for f in ggufs}))
    if not matches:
        how = "" if hub.tag else " and no tag was given"
        raise CheckpointError(f"{where} has no .gguf file tagged {tag}{how} (tags found: {tags}): "
                              f"use {hub.repo_id}:TAG or {hub.repo_id}/FILE.gguf")
    if any(_SPLIT.search(_stem(f)) for f in matches):
        raise CheckpointError(f"{hub.repo_id}:{tag} is split into {len(matches)} files ({matches[0]}, ...): "
                              "specserve reads single-file GGUFs (merge them with `llama-gguf-split --merge`)")
    if len(matches) > 1:
        raise CheckpointError(f"{hub.repo_id}:{tag} matches {len(matches)} files ({', '.join(matches)}): "
                              f"name one as {hub.repo_id}/FILE.gguf")
    return matches[0]


def _stem(name: str) -> str:
    return os.path.basename(name)[: -len(".gguf")]


def _tag_of(name: str) -> str:
    """The quant tag a GGUF file name carries (its last one), else the whole name."""
    stem = _SPLIT.sub("", _stem(name))
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else os.path.basename(name)


# -- the repo's files: the hub's listing, or what the cache holds ----------------------------------------------
def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_note() -> str:
    return " in the local cache" if _offline() else ""


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The files of ``repo_id`` at ``revision``: listed by the hub, or offline (or with the hub out of reach)
    those of the cached snapshot."""
    from huggingface_hub import list_repo_files
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if not _offline():
        try:
            return list(list_repo_files(repo_id, revision=revision))
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except Exception:  # no connection, the hub down: the cache may still hold the repo
            if (cached := _cached_files(repo_id, revision)) is None:
                raise
            return cached
    if (cached := _cached_files(repo_id, revision)) is None:
        raise LocalEntryNotFoundError(f"{repo_id} is not cached")
    return cached


def _cached_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The files of the cached snapshot of ``repo_id`` at ``revision`` (a commit, or a ref the cache
    recorded under ``refs/``), '/'-separated; None when the cache has no such snapshot."""
    from huggingface_hub import constants

    storage = os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"))
    rev = revision or constants.DEFAULT_REVISION
    commit: str | None = rev if _COMMIT.fullmatch(rev) else None
    if commit is None:
        try:
            with open(os.path.join(storage, "refs", rev), encoding="utf-8") as f:
                commit = f.read().strip()
        except OSError:
            return None
    snapshot = os.path.join(storage, "snapshots", commit)
    if not os.path.isdir(snapshot):
        return None
    return sorted(os.path.relpath(os.path.join(d, n), snapshot).replace(os.sep, "/")
                  for d, _, names in os.walk(snapshot) for n in names)


def _explain(e: Exception, spec: str, hub: HubId, revision: str | None) -> str:
    """One line for a failed fetch: what went wrong and what to do."""
    from huggingface_hub import constants, errors

    repo = hub.repo_id
    at = f" at revision {revision}" if revision else ""
    if isinstance(e, errors.GatedRepoError):
        return (f"{repo} is a gated repository: accept its license at https://huggingface.co/{repo} and set "
                f"HF_TOKEN to a token of that account (or run `hf auth login`)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{repo} has no revision {revision!r} on the Hugging Face hub"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{spec}: no such file or directory, and no model repository {repo} on the Hugging Face hub "
                f"(a private one needs HF_TOKEN)")
    if isinstance(e, errors.EntryNotFoundError) and not isinstance(e, errors.LocalEntryNotFoundError):
        return f"{repo}{at} has no file {hub.filename}"
    download = f"`hf download {repo}{f' {hub.filename}' if hub.filename else ''}" \
               f"{f' --revision {revision}' if revision else ''}`"
    if _offline():
        return (f"{spec}{at} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE=1: run once online or {download}")
    if isinstance(e, errors.LocalEntryNotFoundError) or _is_connection_error(e):
        return (f"cannot reach the Hugging Face hub for {spec}{at} and it is not in the local cache: check the "
                f"network (or HF_ENDPOINT), or run {download} where the hub is reachable")
    detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{spec}{at}: cannot fetch it from the Hugging Face hub ({type(e).__name__}: {detail})"


def _is_connection_error(e: BaseException) -> bool:
    names: set[str] = {c.__name__ for c in type(e).__mro__}
    cause: Any = e.__cause__ or e.__context__
    return bool(names & {"ConnectionError", "ConnectError", "TimeoutException", "Timeout"}) or (
        cause is not None and cause is not e and _is_connection_error(cause))
