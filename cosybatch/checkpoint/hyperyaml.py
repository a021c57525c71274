"""A minimal reader for the HyperPyYAML files that CosyVoice checkpoints ship.

The official loader (``hyperpyyaml``) imports and *builds* every ``!new:`` object and runs
every ``!apply:`` call (seeding the RNGs, for example).  cosybatch only needs the numbers, so
here object tags are recorded as :class:`YamlObject` and nothing is imported or executed.

Supported: ``!new:path`` / ``!name:path`` / ``!apply:path`` (mapping -> kwargs, sequence ->
args), ``!ref <key>`` (whole-object references), ``!ref <a> * <b>`` (arithmetic on numbers),
``!ref <dir>/x`` (string interpolation), nested keys ``<a.b>`` / ``<a[b]>``, ``!copy``,
``!tuple``, and YAML-1.2 style floats such as ``1e-06`` (PyYAML alone reads those as strings,
ruamel -- which hyperpyyaml uses -- reads them as floats).
"""

from __future__ import annotations

import ast
import copy
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["HyperYamlError", "YamlObject", "load_hyperyaml", "parse_hyperyaml"]


class HyperYamlError(ValueError):
    """The yaml is malformed or a ``!ref`` cannot be resolved."""


@dataclass
class YamlObject:
    """A recorded ``!new:`` / ``!name:`` / ``!apply:`` node (never built, never called)."""

    tag: str  # "new" | "name" | "apply"
    target: str  # dotted import path, e.g. "cosyvoice.llm.llm.CosyVoice3LM"
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def get(self, key: str, default: Any = None) -> Any:
        return self.kwargs.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]

    def __contains__(self, key: str) -> bool:
        return key in self.kwargs


@dataclass(frozen=True)
class _Ref:
    expr: str
    copy: bool = False


class _Loader(yaml.SafeLoader):
    """SafeLoader plus the HyperPyYAML tags; a subclass so the global SafeLoader is untouched."""


# YAML 1.1 (PyYAML) wants a dot in the mantissa and a sign in the exponent; YAML 1.2 does not.
# Registered after the built-in int resolver, so plain integers stay ints.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _object_constructor(kind: str):
    def construct(loader: _Loader, suffix: str, node: yaml.Node) -> YamlObject:
        if isinstance(node, yaml.MappingNode):
            return YamlObject(kind, suffix, [], dict(loader.construct_mapping(node, deep=True)))
        if isinstance(node, yaml.SequenceNode):
            return YamlObject(kind, suffix, list(loader.construct_sequence(node, deep=True)), {})
        value = loader.construct_scalar(node)
        return YamlObject(kind, suffix, [] if value in ("", None) else [value], {})

    return construct


def _ref_constructor(make_copy: bool):
    def construct(loader: _Loader, node: yaml.Node) -> _Ref:
        if not isinstance(node, yaml.ScalarNode):
            raise HyperYamlError(f"!ref/!copy takes a scalar, got {node.id} at {node.start_mark}")
        return _Ref(str(loader.construct_scalar(node)).strip(), make_copy)

    return construct


def _tuple_constructor(loader: _Loader, node: yaml.Node) -> tuple:
    if isinstance(node, yaml.SequenceNode):
        return tuple(loader.construct_sequence(node, deep=True))
    # hyperpyyaml's scalar form: `!tuple (1, 2)`
    body = str(loader.construct_scalar(node)).strip()
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    return tuple(yaml.load(item, Loader=_Loader) for item in body.split(",") if item.strip())  # noqa: S506


def _include_constructor(loader: _Loader, node: yaml.Node):
    raise HyperYamlError(f"!include is not supported (at {node.start_mark})")


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _object_constructor(_kind))
_Loader.add_constructor("!ref", _ref_constructor(False))
_Loader.add_constructor("!copy", _ref_constructor(True))
_Loader.add_constructor("!tuple", _tuple_constructor)
_Loader.add_constructor("!include", _include_constructor)

_KEY_RE = re.compile(r"<([^<>]+)>")
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _arith(node: ast.AST, names: dict[str, Any]) -> Any:
    """Evaluate a numeric expression tree; anything but numbers and + - * / // % ** is refused."""
    if isinstance(node, ast.Expression):
        return _arith(node.body, names)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_arith(node.left, names), _arith(node.right, names))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_arith(node.operand, names))
    raise TypeError("not arithmetic")


class _Resolver:
    def __init__(self, root: dict):
        self.root = root
        self.visited: set[int] = set()
        self.active: list[str] = []

    def tree(self, node: Any) -> Any:
        if isinstance(node, _Ref):
            return self.ref(node)
        if isinstance(node, tuple):
            return tuple(self.tree(x) for x in node)
        if id(node) in self.visited:
            return node  # keeps shared objects (hifigan.generator is hift) identical
        if isinstance(node, dict):
            self.visited.add(id(node))
            for k in list(node):
                node[k] = self.tree(node[k])
        elif isinstance(node, list):
            self.visited.add(id(node))
            for i, x in enumerate(node):
                node[i] = self.tree(x)
        elif isinstance(node, YamlObject):
            self.visited.add(id(node))
            self.tree(node.args)
            self.tree(node.kwargs)
        return node

    def lookup(self, key: str) -> Any:
        if key in self.active:
            raise HyperYamlError(f"circular !ref: {' -> '.join(self.active + [key])}")
        self.active.append(key)
        try:
            if key in self.root:
                return self.tree(self.root[key])
            parts = [p for p in re.split(r"[.\[\]'\"]+", key) if p]
            node: Any = self.root
            for depth, part in enumerate(parts):
                try:
                    if isinstance(node, YamlObject):
                        node = node.kwargs[part]
                    elif isinstance(node, dict):
                        node = node[part]
                    elif isinstance(node, (list, tuple)):
                        node = node[int(part)]
                    else:
                        raise KeyError(part)
                except (KeyError, IndexError, ValueError):
                    where = ".".join(parts[:depth]) or "<top level>"
                    raise HyperYamlError(f"!ref <{key}>: no key {part!r} under {where}") from None
                node = self.tree(node)
            return node
        finally:
            self.active.pop()

    def ref(self, ref: _Ref) -> Any:
        keys = _KEY_RE.findall(ref.expr)
        if not keys:
            raise HyperYamlError(f"!ref {ref.expr!r} names no <key>")
        whole = _KEY_RE.fullmatch(ref.expr)
        if whole:
            value = self.lookup(whole.group(1).strip())
            return copy.deepcopy(value) if ref.copy else value
        values = {k: self.lookup(k.strip()) for k in keys}
        names = {f"_ref{i}": values[k] for i, k in enumerate(dict.fromkeys(keys))}
        by_key = {k: f"_ref{i}" for i, k in enumerate(dict.fromkeys(keys))}
        expr = _KEY_RE.sub(lambda m: by_key[m.group(1)], ref.expr)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values())
        if numeric:
            try:
                return _arith(ast.parse(expr, mode="eval"), names)
            except (SyntaxError, TypeError, ZeroDivisionError):
                pass
        # Not arithmetic: hyperpyyaml then splices the values into the text (paths, names).
        return _KEY_RE.sub(lambda m: str(values[m.group(1)]), ref.expr)


def parse_hyperyaml(text: str, overrides: dict | None = None) -> dict:
    """Parse HyperPyYAML text into plain dicts/lists with ``YamlObject`` records; refs resolved.

    ``overrides`` replace top-level keys before references are resolved (as hyperpyyaml's
    ``overrides=`` does for ``qwen_pretrain_path``).
    """
    try:
        root = yaml.load(text, Loader=_Loader)  # noqa: S506 -- _Loader derives from SafeLoader
    except yaml.YAMLError as e:
        raise HyperYamlError(f"invalid yaml: {e}") from e
    if root is None:
        root = {}
    if not isinstance(root, dict):
        raise HyperYamlError(f"top level must be a mapping, got {type(root).__name__}")
    if overrides:
        root.update(overrides)
    return _Resolver(root).tree(root)


def load_hyperyaml(path: str | Path, overrides: dict | None = None) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise HyperYamlError(f"{path}: cannot read: {e}") from e
    try:
        return parse_hyperyaml(text, overrides)
    except HyperYamlError as e:
        raise HyperYamlError(f"{path}: {e}") from e
