"""Python's bytecode kept where an image would have every run compile its imports again
(design.md D38).

An import runs a module from its bytecode when the bytecode is where ``importlib`` looks (the
package's ``__pycache__``, or ``sys.pycache_prefix``'s tree) and otherwise compiles the source,
writing the bytecode unless ``PYTHONDONTWRITEBYTECODE`` is set or the folder is read-only.
Images that install torch without its bytecode and set that variable (the H200 image this
project is measured on does) make every run compile torch's ~700 modules again: a 16-row
``synth`` spent 3.3-3.4 s on its imports there against 1.9-2.2 s with the bytecode kept under a
prefix. So the ``cosybatch`` command keeps it under a cache folder of its user's, never beside
the sources (which is what that variable guards), unless told otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping

# The module whose bytecode tells: the largest import of a run by far
PROBE = "torch"
OFF = ("off", "0", "no", "false")


def default_folder(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cosybatch" / "pycache"


def keep_bytecode(environ: Mapping[str, str] = os.environ, module: str = PROBE) -> Path | None:
    """When this process would compile ``module``'s source and keep no bytecode (none installed,
    and ``PYTHONDONTWRITEBYTECODE`` set or its ``__pycache__`` not writable), keep every later
    import's bytecode under a folder (``COSYBATCH_PYCACHE``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``cosybatch/pycache``) and have this process's children do the same (they
    import torch too). Returns the folder, or None: bytecode installed or kept already, a
    ``PYTHONPYCACHEPREFIX`` of the user's, ``COSYBATCH_PYCACHE=off``, or no writable folder.
    Call it before the heavy imports: it changes where the later ones look."""
    choice = environ.get("COSYBATCH_PYCACHE", "")
    if choice.lower() in OFF or sys.pycache_prefix is not None:
        return None
    spec = importlib.util.find_spec(module)  # (finds the package without importing it)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return None
    beside = Path(importlib.util.cache_from_source(origin))
    if beside.exists():
        return None
    folder = beside.parent if beside.parent.is_dir() else beside.parent.parent
    if not sys.dont_write_bytecode and os.access(folder, os.W_OK):
        return None  # this run writes it beside the source, and the next reads it
    try:
        prefix = Path(choice) if choice else default_folder(environ)
        prefix.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # (RuntimeError: no home folder to put it in)
        return None
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    # the helper processes (prompt audio, the text normalizer, Triton's compiles) start Python anew
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return prefix
