"""Checkpoint directories: locate (never download), read the config, load weights strictly."""

from cosybatch.checkpoint.hyperyaml import HyperYamlError, YamlObject, load_hyperyaml, parse_hyperyaml
from cosybatch.checkpoint.loader import (
    BLANK_EN,
    LoadedModels,
    config_from_yaml,
    flow_state_dict,
    fold_weight_norm,
    hift_state_dict,
    llm_state_dict,
    load_config,
    load_models,
    read_state_dict,
    strict_load,
)
from cosybatch.checkpoint.resolve import DEFAULT_REPO, YAML_NAME, CheckpointError, resolve_model_dir

__all__ = [
    "BLANK_EN",
    "DEFAULT_REPO",
    "YAML_NAME",
    "CheckpointError",
    "HyperYamlError",
    "LoadedModels",
    "YamlObject",
    "config_from_yaml",
    "flow_state_dict",
    "fold_weight_norm",
    "hift_state_dict",
    "llm_state_dict",
    "load_config",
    "load_hyperyaml",
    "load_models",
    "parse_hyperyaml",
    "read_state_dict",
    "resolve_model_dir",
    "strict_load",
]
