"""Find a checkpoint directory from a local path or a repo id, without ever downloading.

Bulk jobs run on machines that are often offline; a silent multi-GB download from inside a
job is worse than a clear error that says how to fetch the files once.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CheckpointError", "DEFAULT_REPO", "YAML_NAME", "resolve_model_dir", "hf_cache_dirs"]

DEFAULT_REPO = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
YAML_NAME = "cosyvoice3.yaml"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, or does not match the model code."""


def hf_cache_dirs() -> list[Path]:
    """Hub cache roots in huggingface_hub's order of precedence (duplicates removed)."""
    env = os.environ
    cands: list[Path] = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            cands.append(Path(env[var]).expanduser())
    if env.get("HF_HOME"):
        cands.append(Path(env["HF_HOME"]).expanduser() / "hub")
    if env.get("XDG_CACHE_HOME"):
        cands.append(Path(env["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub")
    cands.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(cands))


def _modelscope_cache_dirs() -> list[Path]:
    env = os.environ
    roots = []
    if env.get("MODELSCOPE_CACHE"):
        roots.append(Path(env["MODELSCOPE_CACHE"]).expanduser())
    roots.append(Path.home() / ".cache" / "modelscope" / "hub")
    return list(dict.fromkeys(roots))


def _hf_snapshot(cache: Path, repo_id: str) -> Path | None:
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snaps = repo_dir / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        rev = ref.read_text(encoding="utf-8").strip()
        if (snaps / rev / YAML_NAME).is_file():
            return snaps / rev
    # No usable refs/main (e.g. a pinned revision was fetched): newest complete snapshot.
    found = [p for p in snaps.iterdir() if (p / YAML_NAME).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _modelscope_dir(root: Path, repo_id: str) -> Path | None:
    org, name = repo_id.split("/", 1)
    # modelscope stores dots in names as "___" on disk.
    for sub in (Path(org) / name, Path(org) / name.replace(".", "___")):
        for base in (root, root / "models"):
            if (base / sub / YAML_NAME).is_file():
                return base / sub
    return None


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not s.startswith((".", "~"))
        and not any(p in (".", "..") for p in parts)
    )


def _download_hint(repo_id: str) -> str:
    local = Path("pretrained_models") / repo_id.split("/")[-1]
    return (
        "cosybatch never downloads checkpoints. Fetch it once, then pass the directory:\n"
        f"  huggingface-cli download {repo_id} --local-dir {local}\n"
        f"  (or: modelscope download --model {repo_id} --local_dir {local})\n"
        f"  cosybatch ... --model {local}"
    )


def _checked(path: Path) -> Path:
    if not (path / YAML_NAME).is_file():
        raise CheckpointError(
            f"{path} is not a CosyVoice3 checkpoint directory: {YAML_NAME} is missing "
            "(expected the Fun-CosyVoice3 layout: cosyvoice3.yaml, llm.pt, flow.pt, hift.pt, "
            "campplus.onnx, speech_tokenizer_v3.onnx, CosyVoice-BlankEN/)"
        )
    return path.resolve()


def resolve_model_dir(name_or_path: str | os.PathLike | None = None) -> Path:
    """A checkpoint directory: ``name_or_path`` itself if it is a directory, else the local
    Hugging Face (then ModelScope) cache entry for that repo id. Raises CheckpointError."""
    if name_or_path is None or str(name_or_path).strip() == "":
        name_or_path = DEFAULT_REPO
    raw = str(name_or_path).strip()
    path = Path(raw).expanduser()
    if path.is_dir():
        return _checked(path)
    if path.exists():
        raise CheckpointError(f"{path} is a file; --model wants a checkpoint directory or a repo id")
    if not _looks_like_repo_id(raw):
        raise CheckpointError(f"model directory {path} does not exist.\n" + _download_hint(DEFAULT_REPO))

    searched = []
    for cache in hf_cache_dirs():
        searched.append(str(cache / ("models--" + raw.replace("/", "--"))))
        snap = _hf_snapshot(cache, raw)
        if snap is not None:
            return snap.resolve()
    for root in _modelscope_cache_dirs():
        searched.append(str(root / raw))
        found = _modelscope_dir(root, raw)
        if found is not None:
            return found.resolve()
    where = "\n".join(f"  {s}" for s in searched)
    raise CheckpointError(
        f"{raw!r} is neither a local directory nor a repo found in the local caches.\n"
        f"Searched:\n{where}\n" + _download_hint(raw)
    )
