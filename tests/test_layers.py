"""Imports point one way, in the order data flows (docs/design.md, "Layout"): a module imports only
from its own rank or lower ones, and the three stages of rank 2 (frontend, engine, codec) never import
each other. Every import counts, the ones inside functions and under TYPE_CHECKING included.

A folder's modules take the folder's rank; a module loose at the package's top level must be listed
by name, so a new one fails here until it is given a rank."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "cosybatch"

# (rank, group): top-level modules by name, folders (trailing ".") for every module inside them.
LAYERS = {
    # 0: neutral leaves every stage may use: the prompt type, the hop schedule, atomic files, GPU helpers,
    # the helper process for GIL-holding row work
    "cosybatch": (0, None), "cosybatch.prompt": (0, None), "cosybatch.hops": (0, None),
    "cosybatch.atomic": (0, None), "cosybatch.gpu.": (0, None), "cosybatch.helper_process": (0, None),
    # 1: plain models, audio and text processing, checkpoints, the manifest
    "cosybatch.models.": (1, None), "cosybatch.audio.": (1, None), "cosybatch.text.": (1, None),
    "cosybatch.checkpoint.": (1, None), "cosybatch.manifest": (1, None),
    # 2: the three stages a row flows through, independent of each other
    "cosybatch.frontend.": (2, "frontend"), "cosybatch.engine.": (2, "engine"), "cosybatch.codec.": (2, "codec"),
    # 3: what a row becomes on disk, and the exact oracle every fast path is tested against
    "cosybatch.output.": (3, None), "cosybatch.reference.": (3, None),
    # 4: the GPU timeline that drives the three stages
    "cosybatch.scheduler.": (4, None),
    # 5: profiles, resolved into the scheduler's typed settings
    "cosybatch.profiles.": (5, None),
    # 6: synthesizers built from a profile, and the benchmark around them
    "cosybatch.synthesizers": (6, None), "cosybatch.bench.": (6, None),
    # 7: running a job: rows, resume, shards, signals, workers, Ray
    "cosybatch.run.": (7, None),
    # 8: the command line
    "cosybatch.cli": (8, None), "cosybatch.__main__": (8, None),
}


def _layer(module: str):
    # a module by name, else its innermost listed folder (a folder's own __init__ included)
    best = module if module in LAYERS else max((p for p in LAYERS if p.endswith(".") and (module + ".").startswith(p)),
                                               key=len, default=None)
    if best is None:
        raise AssertionError(f"{module}: not in the layer table of tests/test_layers.py; add it")
    return LAYERS[best]


def _modules():
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, f


def _is_module(dotted: str) -> bool:
    p = ROOT.parent / dotted.replace(".", "/")
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _imports(name: str, path: Path):
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from cosybatch.x import y`: y may be a module of its own
            targets = [f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names]
            yield from ((t, node.lineno) for t in targets)
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)


def test_every_module_has_a_layer():
    for name, _ in _modules():
        _layer(name)


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_point_down(name, path):
    layer, group = _layer(name)
    for target, line in _imports(name, path):
        if not target.startswith("cosybatch"):
            continue
        t_layer, t_group = _layer(target)
        assert t_layer <= layer, f"{path.name}:{line}: {name} (layer {layer}) imports {target} (layer {t_layer})"
        if layer == t_layer == 2:
            assert group == t_group, f"{path.name}:{line}: stage {group} imports stage {t_group} ({target})"
