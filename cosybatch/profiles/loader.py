"""Run profiles: how the engine runs, as one typed, frozen object built from YAML.

A profile file holds the keys of the dataclass tree in :mod:`cosybatch.profile_schema`
(``ar.max_num_seqs: 32``, ...),
optionally ``inherits: NAME|PATH`` (the child's keys win) and ``requires: {dotted.key: value}``
(checked after every override; a child's ``key: null`` drops an inherited requirement).
``--set dotted.key=value`` overrides are typed by YAML and validated exactly like file keys.

Every mistake is a :class:`ProfileError` naming the dotted key and where it came from, raised
before any model work: a profile's requirements are enforced, not comments (design.md D11).

Profile names are looked up in ``$COSYBATCH_PROFILES`` (if set), then among the profiles shipped
inside the package (``cosybatch/profiles/*.yaml``, package data found with importlib.resources,
so a plain wheel install has them); a path (``--profile /path/to/x.yaml``) always works.
"""

from __future__ import annotations

import logging
import os
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import yaml

from cosybatch.profiles.schema import (DEFAULTS, GROUPS, LEAVES, NOT_SETTABLE, RANGES, Profile, ProfileError,
                                      check_requires, check_value, cross_check, flatten, fmt, got, unknown_key)

log = logging.getLogger("cosybatch.profiles")


# --- files, inheritance, overrides -----------------------------------------------------------


def profiles_dirs() -> list[Path]:
    """Where profile names are looked up, first match wins: ``$COSYBATCH_PROFILES``, then the
    shipped ones."""
    dirs = [Path(d) for d in os.environ.get("COSYBATCH_PROFILES", "").split(os.pathsep) if d]
    return dirs + [_shipped_dir()]


def _shipped_dir() -> Path:
    # The YAMLs sit beside this module as package data; files() gives their real folder for an
    # installed wheel and an editable checkout alike (the package is never zipped).
    return Path(str(resources.files("cosybatch.profiles")))


def available_profiles() -> list[str]:
    return sorted({p.stem for d in profiles_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def describe_profiles() -> list[tuple[str, str, Path]]:
    """(name, description, file) of every profile a name can reach, the winning file per name."""
    out = []
    for name in available_profiles():
        path = resolve_profile_path(name)
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            out.append((name, f"(unreadable: {e})", path))
            continue
        desc = doc.get("description") if isinstance(doc, dict) else None
        out.append((name, str(desc or ""), path))
    return out


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.endswith((".yaml", ".yml"))


def resolve_profile_path(spec: str | os.PathLike, base: Path | None = None) -> Path:
    """A profile name (looked up in :func:`profiles_dirs`) or a path (relative to ``base``)."""
    s = os.fspath(spec)
    if _looks_like_path(s):
        p = Path(s).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise ProfileError(f"profile file not found: {p}")
        return p
    for d in profiles_dirs():
        if (d / f"{s}.yaml").is_file():
            return d / f"{s}.yaml"
    raise ProfileError(f"unknown profile {s!r}; known: {', '.join(available_profiles()) or '(none)'} "
                       "(or pass a path to a .yaml file)")


@dataclass
class _Layers:
    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    requires: dict[str, Any] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)


def _read_file(path: Path, stack: tuple[Path, ...]) -> _Layers:
    real = path.resolve()
    if real in stack:
        chain = " -> ".join(str(p) for p in (*stack, real))
        raise ProfileError(f"inheritance cycle: {chain}")
    src = str(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{src}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{src}: invalid YAML: {e}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ProfileError(f"{src}: expected a mapping at the top level, got {got(doc)}")
    doc = dict(doc)
    parent = doc.pop("inherits", None)
    requires = doc.pop("requires", None) or {}
    if parent is not None and not isinstance(parent, str):
        raise ProfileError(f"{src}: inherits: expected a profile name or path, got {got(parent)}")
    if not isinstance(requires, dict):
        raise ProfileError(f"{src}: requires: expected a mapping of dotted keys to values, got {got(requires)}")
    own = flatten(doc, src)
    layers = _read_file(resolve_profile_path(parent, path.parent), (*stack, real)) if parent else _Layers()
    layers.values.update(own)
    layers.origins.update({k: src for k in own})
    for key, want in requires.items():
        if not isinstance(key, str) or key not in LEAVES:
            raise unknown_key(str(key), f"{src}: requires")
        if want is None:
            layers.requires.pop(key, None)
        else:
            layers.requires[key] = check_value(key, want, f"{src}: requires")
    layers.sources.append(src)
    return layers


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` -> (``a.b``, typed value); the value is read as a YAML scalar or list."""
    src = f"--set {item}"
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ProfileError(f"{src}: expected KEY=VALUE")
    if key.split(".")[0] in NOT_SETTABLE:
        raise ProfileError(f"{src}: {key.split('.')[0]} cannot be overridden; "
                           "write a profile file that inherits instead")
    if key in GROUPS:
        keys = ", ".join(k for k in LEAVES if k.startswith(key + "."))
        raise ProfileError(f"{src}: {key} is a group; set one of its keys: {keys}")
    if key not in LEAVES:
        raise unknown_key(key, src)
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    tp = LEAVES[key]
    if isinstance(value, str) and (tp is float or float in typing.get_args(tp)):
        try:  # YAML 1.1 reads "1e-3" as a string
            value = float(value)
        except ValueError:
            pass
    return key, check_value(key, value, src)


def _build(values: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, v in values.items():
        head, _, tail = key.partition(".")
        if tail:
            groups.setdefault(head, {})[tail] = v
        else:
            kwargs[key] = v
    hints = typing.get_type_hints(Profile)
    for g, kw in groups.items():
        kwargs[g] = hints[g](**kw)
    return kwargs


def load_profile(spec: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                 *, stream: bool | None = None) -> Profile:
    """Load, merge, override and validate a profile (default: ``default``).

    ``stream`` (the ``synth --stream/--no-stream`` flag) sets ``mode`` like an override, before
    the ``requires`` check, so a streaming-only profile refuses ``--no-stream``.
    """
    path = resolve_profile_path(spec if spec is not None else "default")
    layers = _read_file(path, ())
    for item in overrides:
        key, value = parse_override(item)
        layers.values[key] = value
        layers.origins[key] = f"--set {item}"
    if stream is not None:
        mode = "streaming" if stream else "full"
        flag = "--stream" if stream else "--no-stream"
        if layers.values.get("mode", DEFAULTS.mode) != mode:
            log.info("mode=%s from %s (profile %s said %s)", mode, flag, path.stem,
                     layers.values.get("mode", DEFAULTS.mode))
        layers.values["mode"] = mode
        layers.origins["mode"] = flag
    for key, v in layers.values.items():
        if key in RANGES and not RANGES[key][0](v):
            raise ProfileError(f"{layers.origins[key]}: {key}: {RANGES[key][1]}, got {fmt(v)}")
    name = path.stem
    profile = Profile(**_build(layers.values), name=name, requires=tuple(sorted(layers.requires.items())),
                      sources=tuple(layers.sources), origins=tuple(sorted(layers.origins.items())))
    who = f"profile {name!r} ({path})"
    check_requires(profile, who)
    cross_check(profile, who)
    return profile
