"""Imports point one way (docs/design.md, "Layers"): a module imports only from its own layer or
lower ones, and the three stages of layer 2 (frontend, engine, codec) never import each other.
Every import counts, the ones inside functions and under TYPE_CHECKING included."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "cosybatch"

# (layer, group) by module prefix; the longest matching prefix wins.
LAYERS = {
    # 0: leaf types and helpers every layer may use
    "cosybatch": (0, None), "cosybatch.config": (0, None), "cosybatch.prompt": (0, None),
    "cosybatch.exits": (0, None), "cosybatch.hostcopy": (0, None), "cosybatch.cuda_graphs": (0, None),
    "cosybatch.graph_cache": (0, None),
    "cosybatch.runtime": (0, None), "cosybatch.requests": (0, None), "cosybatch.metrics": (0, None),
    "cosybatch.sampling": (0, None), "cosybatch.devices": (0, None), "cosybatch.startup": (0, None),
    # 1: plain models, audio/text processing, checkpoints, manifests and output files
    "cosybatch.models": (1, None), "cosybatch.audio": (1, None), "cosybatch.text": (1, None),
    "cosybatch.checkpoint": (1, None), "cosybatch.manifest": (1, None), "cosybatch.writer": (1, None),
    # 2: the three stages, independent of each other
    "cosybatch.frontend": (2, "frontend"), "cosybatch.frontend_models": (2, "frontend"),
    "cosybatch.engine": (2, "engine"), "cosybatch.codec": (2, "codec"),
    # 3: the exact oracle, and profiles resolved into the stages' typed configs
    "cosybatch.reference": (3, None), "cosybatch.profiles": (3, None),
    # 4: the pipelines that wire the stages together
    "cosybatch.timeline": (4, None), "cosybatch.serving": (4, None), "cosybatch.pipeline": (4, None),
    # 5: running jobs: rows, resume, shards, workers, benchmarks, the command line
    **{f"cosybatch.{m}": (5, None) for m in ("runner", "resume", "sharding", "merge", "check", "progress", "bench",
                                            "workload", "multi", "worker", "ray", "ray_cli", "ray_stage", "row_records",
                                            "interrupts", "disk_estimate",
                                            "synth_options", "cli", "__main__")},
}


def _layer(module: str):
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module}: not in the layer table of tests/test_layers.py; add it")
    return LAYERS[best]


def _modules():
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, f


def _imports(name: str, path: Path):
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target]
            if node.module is None or target in LAYERS:  # `from cosybatch import x`: x may be a module
                targets = [f"{target}.{a.name}" for a in node.names]
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
