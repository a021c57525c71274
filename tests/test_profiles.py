import dataclasses
import logging
from pathlib import Path

import pytest

from cosybatch.models.config import SamplingConfig
from cosybatch.profiles import (HopsProfile, Optimizations, Profile, ProfileError, SamplingProfile, available_profiles,
                                load_profile, parse_override)
from cosybatch.profiles.resolve import resolve_hops, resolve_sampling
from cosybatch.profiles.schema import LEAVES

SHIPPED = ["default", "packed_streaming", "packed_streaming_optimized_standard", "reference"]


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def err(spec, overrides=(), **kw) -> str:
    with pytest.raises(ProfileError) as e:
        load_profile(spec, overrides, **kw)
    return str(e.value)


# --- shipped profiles ------------------------------------------------------------------------


def test_shipped_profiles_load():
    assert set(SHIPPED) <= set(available_profiles())
    for name in SHIPPED:
        p = load_profile(name)
        assert p.name == name
        dataclasses.replace(p)  # a real frozen dataclass tree
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.ar.max_num_seqs = 1  # type: ignore[misc]


def test_seed_profile_matches_the_anchor():
    p = load_profile("packed_streaming_optimized_standard")
    assert (p.engine, p.mode) == ("fast", "streaming")
    assert (p.ar.max_num_seqs, p.codec.max_num_seqs) == (32, 32)
    assert p.optimizations.hift_graphs
    o = p.optimizations
    assert (o.hift_graph_capacity, o.hift_graph_counters, o.hift_graph_capture_after) == (32, 128, 3)
    s = p.sampling
    assert (s.mode, s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed, s.max_tokens) == (
        "standard", 0.7, 0.8, 20, 1.21, 42, 2048)
    assert dict(p.requires) == {"sampling.mode": "standard", "mode": "streaming"}
    # inherited from packed_streaming
    # auto = bfloat16 on CUDA (the anchor's BF16 flow), float32 on CPU (parity runs)
    assert p.codec.flow_dtype == "auto"
    assert p.sources[0].endswith("packed_streaming.yaml")
    assert p.origin("ar.max_num_seqs").endswith("packed_streaming_optimized_standard.yaml")
    assert p.origin("codec.flow_dtype").endswith("packed_streaming.yaml")
    assert p.origin("sampling.win_size") == "default"


def test_base_and_reference_profiles():
    base = load_profile("packed_streaming")
    assert (base.ar.max_num_seqs, base.codec.max_num_seqs, base.mode) == (64, 16, "streaming")
    ref = load_profile("reference")
    assert ref.engine == "reference"
    assert ref.ar.dtype == ref.codec.flow_dtype == "float32"
    assert ref.optimizations == Optimizations() and not ref.ar.cuda_graphs
    d = load_profile("default")
    assert d == load_profile(None)
    assert (d.engine, d.mode, d.sampling.mode) == ("fast", "full", "checkpoint")
    assert d.ar.max_num_seqs >= 128 and d.codec.flow_dtype == "auto"


def test_to_dict_round_trips_the_keys():
    d = load_profile("packed_streaming_optimized_standard").to_dict()
    assert d["ar"]["max_num_seqs"] == 32 and d["sampling"]["top_k"] == 20
    assert d["requires"] == {"mode": "streaming", "sampling.mode": "standard"}
    assert "origins" not in d


# --- schema errors (exact messages) ----------------------------------------------------------


def test_unknown_key_names_file_and_dotted_key(tmp_path):
    p = write(tmp_path, "x", "ar:\n  max_num_seq: 4\n")
    ar_keys = ", ".join(k for k in LEAVES if k.startswith("ar."))
    assert err(p) == f"{p}: unknown key 'ar.max_num_seq' (did you mean 'ar.max_num_seqs'?); valid keys of ar: {ar_keys}"
    p = write(tmp_path, "y", "turbo: true\n")
    assert err(p) == f"{p}: unknown key 'turbo'; valid keys: {', '.join(LEAVES)}"


def test_wrong_types(tmp_path):
    cases = {
        "ar:\n  max_num_seqs: many\n": "ar.max_num_seqs: expected an integer, got str 'many'",
        "ar:\n  max_num_seqs: 2.5\n": "ar.max_num_seqs: expected an integer, got float 2.5",
        "ar:\n  cuda_graphs: 1\n": "ar.cuda_graphs: expected true or false, got int 1",
        "ar:\n  max_num_seqs: true\n": "ar.max_num_seqs: expected an integer, got bool True",
        "mode: stream\n": "mode: expected one of 'streaming', 'full', got str 'stream'",
        "codec:\n  attention: xformers\n":
            "codec.attention: expected one of 'auto', 'sdpa', 'varlen', 'flash', 'triton', got str 'xformers'",
        "sampling:\n  mode: standard\n  temperature: hot\n":
            "sampling.temperature: expected a number or null, got str 'hot'",
        "ar: 5\n": "ar: expected a mapping, got int 5",
        "ar:\n  graph_batch_sizes: [1, two]\n":
            "ar.graph_batch_sizes: expected a list of an integer, got list [1, 'two']",
    }
    for text, msg in cases.items():
        p = write(tmp_path, "t", text)
        assert err(p) == f"{p}: {msg}"


def test_ints_are_fine_numbers(tmp_path):
    p = write(tmp_path, "t", "sampling:\n  mode: standard\n  temperature: 1\n")
    t = load_profile(p).sampling.temperature
    assert t == 1.0 and isinstance(t, float)


def test_value_ranges_name_their_source(tmp_path):
    p = write(tmp_path, "t", "ar:\n  max_num_seqs: 0\n")
    assert err(p) == f"{p}: ar.max_num_seqs: must be >= 1, got 0"
    assert err("default", ["sampling.top_p=1.5", "sampling.mode=ras"]) == \
        "--set sampling.top_p=1.5: sampling.top_p: must be in (0, 1], got 1.5"


def test_top_level_must_be_a_mapping(tmp_path):
    p = write(tmp_path, "t", "- a\n- b\n")
    assert err(p) == f"{p}: expected a mapping at the top level, got list ['a', 'b']"
    p = write(tmp_path, "u", "ar: [\n")
    assert err(p).startswith(f"{p}: invalid YAML:")


def test_unknown_profile_name_lists_known_ones():
    msg = err("no_such_profile")
    assert msg.startswith("unknown profile 'no_such_profile'; known: default, packed_streaming,")
    assert err("missing/file.yaml") == "profile file not found: missing/file.yaml"


# --- inheritance ---------------------------------------------------------------------------


def test_inherits_by_path_recursively_child_wins(tmp_path):
    write(tmp_path, "a", "ar:\n  max_num_seqs: 8\n  max_model_len: 1000\ncodec:\n  max_num_seqs: 4\n")
    write(tmp_path, "b", "inherits: a.yaml\nar:\n  max_num_seqs: 16\n")
    c = write(tmp_path, "c", "inherits: ./b.yaml\ncodec:\n  max_num_seqs: 2\n")
    p = load_profile(c)
    assert (p.ar.max_num_seqs, p.ar.max_model_len, p.codec.max_num_seqs) == (16, 1000, 2)
    assert [Path(s).name for s in p.sources] == ["a.yaml", "b.yaml", "c.yaml"]
    assert p.origin("ar.max_model_len") == str(tmp_path / "a.yaml")


def test_inherits_a_shipped_profile_by_name(tmp_path):
    p = load_profile(write(tmp_path, "mine", "inherits: packed_streaming_optimized_standard\nar:\n  max_num_seqs: 64\n"))
    assert p.ar.max_num_seqs == 64 and p.sampling.top_k == 20
    assert dict(p.requires) == {"sampling.mode": "standard", "mode": "streaming"}


def test_error_in_a_parent_names_the_parent_file(tmp_path):
    parent = write(tmp_path, "parent", "codec:\n  flow_dtype: bf16\n")
    child = write(tmp_path, "child", "inherits: parent.yaml\n")
    assert err(child) == (f"{parent}: codec.flow_dtype: expected one of 'auto', 'float32', 'bfloat16', "
                          "'float16', got str 'bf16'")
    orphan = write(tmp_path, "orphan", "inherits: gone.yaml\n")
    assert err(orphan) == f"profile file not found: {tmp_path / 'gone.yaml'}"


def test_inheritance_cycle_is_detected(tmp_path):
    write(tmp_path, "a", "inherits: b.yaml\n")
    b = write(tmp_path, "b", "inherits: a.yaml\n")
    msg = err(b)
    assert msg.startswith("inheritance cycle: ") and msg.count(" -> ") == 2
    s = write(tmp_path, "s", "inherits: s.yaml\n")
    assert err(s) == f"inheritance cycle: {s.resolve()} -> {s.resolve()}"


def test_bad_inherits_and_requires_values(tmp_path):
    p = write(tmp_path, "t", "inherits: 3\n")
    assert err(p) == f"{p}: inherits: expected a profile name or path, got int 3"
    p = write(tmp_path, "t", "requires: [mode]\n")
    assert err(p) == f"{p}: requires: expected a mapping of dotted keys to values, got list ['mode']"
    p = write(tmp_path, "t", "requires:\n  sampling.moed: standard\n")
    assert err(p).startswith(f"{p}: requires: unknown key 'sampling.moed' (did you mean 'sampling.mode'?); "
                             "valid keys of sampling: sampling.mode, ")
    p = write(tmp_path, "t", "requires:\n  mode: live\n")
    assert err(p) == f"{p}: requires: mode: expected one of 'streaming', 'full', got str 'live'"


def test_child_can_drop_an_inherited_requirement(tmp_path):
    p = write(tmp_path, "t", "inherits: packed_streaming_optimized_standard\nrequires:\n  mode: null\nmode: full\n"
              "optimizations:\n  prefix_reuse: false\n")
    prof = load_profile(p)
    assert prof.mode == "full" and dict(prof.requires) == {"sampling.mode": "standard"}


# --- overrides -----------------------------------------------------------------------------


def test_overrides_are_typed_and_validated():
    p = load_profile("packed_streaming", ["ar.max_num_seqs=128", "codec.flow_dtype=float32",
                                          "sampling.mode=ras", "sampling.tau_r=1e-3", "ar.kv_cache_gb=12"])
    assert p.ar.max_num_seqs == 128 and p.codec.flow_dtype == "float32"
    assert p.sampling.tau_r == 0.001 and p.ar.kv_cache_gb == 12.0
    assert p.origin("ar.max_num_seqs") == "--set ar.max_num_seqs=128"
    assert parse_override("ar.graph_batch_sizes=[1, 8]") == ("ar.graph_batch_sizes", (1, 8))
    assert parse_override("sampling.top_k=null") == ("sampling.top_k", None)


def test_override_errors():
    assert err("default", ["ar.max_num_seqs=lots"]) == \
        "--set ar.max_num_seqs=lots: ar.max_num_seqs: expected an integer, got str 'lots'"
    assert err("default", ["ar.xyzzy=1"]) == \
        "--set ar.xyzzy=1: unknown key 'ar.xyzzy'; valid keys of ar: " + ", ".join(k for k in LEAVES if k.startswith("ar."))
    assert err("default", ["hops=1"]) == "--set hops=1: hops is a group; set one of its keys: hops.first, hops.max, hops.scale"
    assert err("default", ["ar.max_num_seqs"]) == "--set ar.max_num_seqs: expected KEY=VALUE"
    assert err("default", ["requires.mode=full"]) == \
        "--set requires.mode=full: requires cannot be overridden; write a profile file that inherits instead"
    assert err("default", ["inherits=reference"]) == \
        "--set inherits=reference: inherits cannot be overridden; write a profile file that inherits instead"
    assert err("default", ["ar.cuda_graphs=maybe"]) == \
        "--set ar.cuda_graphs=maybe: ar.cuda_graphs: expected true or false, got str 'maybe'"


# --- requires (anchor finding 3) -------------------------------------------------------------


def test_requirement_violated_by_override_fails_loudly():
    path = load_profile("packed_streaming_optimized_standard").sources[-1]
    msg = err("packed_streaming_optimized_standard", ["sampling.mode=ras", "sampling.temperature=null",
                                                     "sampling.repetition_penalty=null"])
    assert msg == (f"profile 'packed_streaming_optimized_standard' ({path}) requires sampling.mode=standard, "
                   "got sampling.mode=ras (from --set sampling.mode=ras)")
    msg = err("packed_streaming_optimized_standard", ["mode=full"])
    assert msg == (f"profile 'packed_streaming_optimized_standard' ({path}) requires mode=streaming, "
                   "got mode=full (from --set mode=full)")


def test_stream_flag_is_an_override_checked_by_requires():
    path = load_profile("packed_streaming_optimized_standard").sources[-1]
    assert err("packed_streaming_optimized_standard", stream=False) == (
        f"profile 'packed_streaming_optimized_standard' ({path}) requires mode=streaming, "
        "got mode=full (from --no-stream)")
    assert load_profile("packed_streaming_optimized_standard", stream=True).mode == "streaming"
    p = load_profile("default", stream=True)
    assert p.mode == "streaming" and p.origin("mode") == "--stream"


# --- no silent overrides (anchor finding 4) --------------------------------------------------


def test_removed_switches_are_refused():
    # HiFT always runs in float32 with the cached ISTFT (bit-equal to torch.istft): the keys that
    # pretended to choose otherwise are gone, and a profile still setting them is told so
    for kv in ("optimizations.cached_istft=true", "codec.hift_dtype=float32"):
        assert "unknown" in err("packed_streaming", [kv])


def test_reference_engine_refuses_fast_settings():
    path = load_profile("reference").sources[-1]
    msg = err("reference", ["ar.max_num_seqs=8"])
    assert msg == (f"profile 'reference' ({path}): engine=reference runs the exact one-request path and does "
                   "not use ar.max_num_seqs=8 (from --set ar.max_num_seqs=8); unset it or use engine=fast")
    msg = err("packed_streaming", ["engine=reference"])
    assert "does not use ar.dtype=auto (from " in msg and "codec.flow_dtype=auto" in msg
    assert "ar.max_num_seqs" not in msg  # 64 is the schema default: nothing to ignore


def test_sampling_parameters_unused_by_the_mode_are_errors():
    path = load_profile("default").sources[-1]
    assert err("default", ["sampling.top_k=20"]) == (
        f"profile 'default' ({path}): sampling.top_k=20 (from --set sampling.top_k=20) is not used by "
        f"sampling.mode=checkpoint (from {path}); set it to null or pick a mode that uses it")
    msg = err("default", ["sampling.mode=standard", "sampling.win_size=5"])
    assert "sampling.win_size=5" in msg and "sampling.mode=standard" in msg
    msg = err("default", ["sampling.mode=ras", "sampling.temperature=0.7"])
    assert "sampling.temperature=0.7" in msg and "not used by sampling.mode=ras" in msg


def test_streaming_only_optimizations_and_hop_order():
    msg = err("default", ["optimizations.chunk_causal_final=true"])
    assert "optimizations.chunk_causal_final=true" in msg and "applies only to mode=streaming, got mode=full" in msg
    msg = err("packed_streaming", ["hops.first=50", "hops.max=25"])
    assert "hops.max=25 (from --set hops.max=25) must be >= hops.first=50" in msg
    msg = err("packed_streaming", ["optimizations.hift_graph_counters=8"])
    assert "optimizations.hift_graph_counters=8" in msg and "must be >= optimizations.hift_graph_capacity=32" in msg


# --- what the engine gets ------------------------------------------------------------------


def test_resolve_sampling(caplog):
    ckpt = SamplingConfig(top_p=0.7, top_k=11, win_size=7, tau_r=0.2)
    with caplog.at_level(logging.INFO, logger="cosybatch.profiles"):
        e = resolve_sampling(SamplingProfile(mode="checkpoint", seed=3), ckpt)
    assert (e.mode, e.top_p, e.top_k, e.win_size, e.tau_r, e.seed) == ("ras", 0.7, 11, 7, 0.2, 3)
    assert e.ras_config() == ckpt
    assert "from the checkpoint's yaml" in caplog.text
    e = resolve_sampling(SamplingProfile(mode="ras", top_k=5), ckpt)
    assert (e.top_k, e.top_p) == (5, 0.7)
    s = load_profile("packed_streaming_optimized_standard").sampling
    e = resolve_sampling(s, ckpt)
    assert (e.mode, e.temperature, e.top_p, e.top_k, e.repetition_penalty, e.max_tokens) == (
        "standard", 0.7, 0.8, 20, 1.21, 2048)
    e = resolve_sampling(SamplingProfile(mode="standard"), ckpt)
    assert (e.temperature, e.top_p, e.top_k, e.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_resolve_hops():
    assert resolve_hops(HopsProfile(), 25) == (25, 100, 2)
    # The official schedule is 25 -> 100 whatever the checkpoint's chunk size (design.md D3).
    assert resolve_hops(HopsProfile(), 10) == (25, 100, 2)
    assert resolve_hops(HopsProfile(first=50, max=200, scale=3), 25) == (50, 200, 3)
    assert resolve_hops(HopsProfile(first=30), 25) == (30, 100, 2)
    with pytest.raises(ProfileError, match=r"hops.max=20 must be >= hops.first=30"):
        resolve_hops(HopsProfile(first=30, max=20), 25)


def test_profile_get_and_default_tree():
    p = Profile()
    assert p.get("ar.max_num_seqs") == 64 and p.get("mode") == "full"
    assert p.optimizations.chunk_causal_final is False


def test_hift_graph_precapture_shapes():
    p = load_profile("packed_streaming_optimized_standard", ["optimizations.hift_graph_precapture=[[1, 96], [8, 128]]"])
    assert p.optimizations.hift_graph_precapture == ((1, 96), (8, 128))
    with pytest.raises(ProfileError, match=r"hift_graph_precapture.*\[requests, frames\] pairs"):
        load_profile("packed_streaming_optimized_standard", ["optimizations.hift_graph_precapture=[[1, 96, 3]]"])
    with pytest.raises(ProfileError, match=r"hift_graph_precapture: expected a list of a list of an integer"):
        load_profile("packed_streaming_optimized_standard", ["optimizations.hift_graph_precapture=[[1, x]]"])
    with pytest.raises(ProfileError, match=r"hift_graph_precapture needs optimizations.hift_graphs=true"):
        load_profile("packed_streaming", ["optimizations.hift_graph_precapture=[[1, 96]]"])


def test_flow_graph_precapture_range():
    p = load_profile("default", ["optimizations.flow_graph_precapture=6144", "optimizations.flow_graph_precapture_from=4096"])
    assert (p.optimizations.flow_graph_precapture, p.optimizations.flow_graph_precapture_from) == (6144, 4096)
    with pytest.raises(ProfileError, match=r"flow_graph_precapture_from needs optimizations.flow_graph_precapture "
                                           r"at least as large.*4096.*null"):
        load_profile("default", ["optimizations.flow_graph_precapture=null", "optimizations.flow_graph_precapture_from=4096"])
    with pytest.raises(ProfileError, match=r"flow_graph_precapture_from needs"):
        load_profile("default", ["optimizations.flow_graph_precapture=2048", "optimizations.flow_graph_precapture_from=4096"])


def test_hift_tf32_is_explicit():
    assert load_profile("reference").codec.hift_tf32 is False  # the schema default: strict float32
    assert load_profile("default").codec.hift_tf32 is True
    assert load_profile("packed_streaming_optimized_standard").codec.hift_tf32 is True  # inherited
    assert load_profile("default", ["codec.hift_tf32=false"]).codec.hift_tf32 is False


def test_slice_settings_reach_the_timeline_limits():
    import torch

    from cosybatch.models.config import ModelConfig
    from cosybatch.profiles.resolve import resolve

    p = load_profile("packed_streaming", ["codec.first_wait_ms=120", "codec.max_wait_ms=400",
                                          "codec.solve_tokens=9000", "codec.budget_ms=7.5", "codec.budget_max_ms=20"])
    cfg, cpu = ModelConfig(), torch.device("cpu")
    s = resolve(p, cfg, cpu).slices
    assert (s.budget_ms, s.budget_max_ms, s.solve_tokens, s.first_wait_s, s.max_wait_s) == (7.5, 20.0, 9000, 0.12, 0.4)
    default = resolve(load_profile("packed_streaming"), ModelConfig(), torch.device("cpu")).slices
    assert default.solve_tokens is None and default.budget_max_ms is None
    assert default.deadline_lead_s is None and resolve(load_profile("default"), cfg, cpu).ar_stream == "serial"
    on = resolve(load_profile("packed_streaming", ["codec.deadline_lead_ms=600", "codec.deadline_tokens=6000",
                                                   "scheduler.ar_stream=beside"]), cfg, cpu)
    assert (on.slices.deadline_lead_s, on.slices.deadline_tokens, on.ar_stream) == (0.6, 6000, "beside")
    assert not on.slices.first_apart
    assert resolve(load_profile("packed_streaming", ["codec.first_hops_apart=true"]), cfg, cpu).slices.first_apart
    assert err("packed_streaming", ["codec.deadline_lead_ms=200"]).endswith("must be > 250 (the imminent-deadline margin), got 200.0")
    assert "one of 'serial', 'beside'" in err("packed_streaming", ["scheduler.ar_stream=parallel"])
    # the GPU frontend's launches: serial unless asked (design.md D34)
    assert resolve(load_profile("default"), cfg, cpu).frontend_stream == "serial"
    assert resolve(load_profile("default", ["scheduler.frontend_stream=beside"]), cfg, cpu).frontend_stream == "beside"
    assert "one of 'serial', 'beside'" in err("default", ["scheduler.frontend_stream=side"])
    # HiFT's calls: likewise (design.md D36)
    assert resolve(load_profile("default"), cfg, cpu).hift_stream == "serial"
    assert resolve(load_profile("default", ["scheduler.hift_stream=beside"]), cfg, cpu).hift_stream == "beside"
    assert err("packed_streaming", ["codec.first_wait_ms=-1"]) == \
        "--set codec.first_wait_ms=-1: codec.first_wait_ms: must be >= 0, got -1.0"


def test_triton_kernels_only_where_cuda_and_triton_are(monkeypatch):
    """``optimizations.triton_kernels`` (on by default) reaches the codec only on CUDA with Triton
    importable; on CPUs, without Triton or when switched off, the eager ops run."""
    import torch

    from cosybatch.models.config import ModelConfig
    from cosybatch.profiles import resolve as r

    cfg, cuda, cpu = ModelConfig(), torch.device("cuda"), torch.device("cpu")
    assert load_profile("packed_streaming").optimizations.triton_kernels is True
    monkeypatch.setattr(r, "triton_available", lambda: True)
    assert r.resolve(load_profile("packed_streaming"), cfg, cuda).codec.triton_kernels is True
    assert r.resolve(load_profile("packed_streaming"), cfg, cpu).codec.triton_kernels is False
    off = load_profile("packed_streaming", ["optimizations.triton_kernels=false"])
    assert r.resolve(off, cfg, cuda).codec.triton_kernels is False
    monkeypatch.setattr(r, "triton_available", lambda: False)
    assert r.resolve(load_profile("packed_streaming"), cfg, cuda).codec.triton_kernels is False


def test_frontend_device_and_precision():
    """``frontend.device`` picks the implementation, ``frontend.precision`` its arithmetic; the
    shipped fast profiles run the tokenizer's GEMMs as 3xTF32, the schema default is strict."""
    import torch

    from cosybatch.models.config import ModelConfig
    from cosybatch.profiles.resolve import resolve

    cfg, cpu = ModelConfig(), torch.device("cpu")
    assert load_profile("reference").frontend.precision == "float32"
    for name in ("default", "packed_streaming", "packed_streaming_optimized_standard"):
        f = resolve(load_profile(name), cfg, cpu).frontend
        assert (f.backend, f.dtype, f.split_tf32) == ("auto", torch.float32, True), name
    f = resolve(load_profile("default", ["frontend.device=cpu", "frontend.precision=bfloat16"]), cfg, cpu).frontend
    assert (f.backend, f.dtype, f.split_tf32) == ("onnxruntime", torch.bfloat16, False)
    f = resolve(load_profile("default", ["frontend.device=cuda"]), cfg, torch.device("cuda")).frontend
    assert f.backend == "torch"
    with pytest.raises(ProfileError, match="frontend.device=cuda needs a CUDA device, the run uses cpu"):
        resolve(load_profile("default", ["frontend.device=cuda"]), cfg, cpu)
    assert err("default", ["frontend.precision=fp16"]) == ("--set frontend.precision=fp16: frontend.precision: "
                                                           "expected one of 'float32', '3xtf32', 'bfloat16', got str 'fp16'")
    assert "frontend.precision=3xtf32 (from " in err("default", ["engine=reference", "mode=full"])
    assert f.batch == 64 and resolve(load_profile("default", ["frontend.batch=16"]), cfg, cpu).frontend.batch == 16
    assert err("default", ["frontend.batch=0"]) == "--set frontend.batch=0: frontend.batch: must be >= 1, got 0"
    assert f.row_bucket == 16 and resolve(load_profile("default", ["frontend.row_bucket=8"]), cfg, cpu).frontend.row_bucket == 8
    assert err("default", ["frontend.row_bucket=0"]) == "--set frontend.row_bucket=0: frontend.row_bucket: must be >= 1, got 0"
    assert f.batch_bucket_s == 0.5 and f.prime is False
    assert resolve(load_profile("default", ["frontend.prime=true"]), cfg, cpu).frontend.prime is True
    assert resolve(load_profile("default", ["frontend.batch_bucket_s=2"]), cfg, cpu).frontend.batch_bucket_s == 2.0
    assert err("default", ["frontend.batch_bucket_s=0"]).endswith("frontend.batch_bucket_s: must be > 0, got 0.0")
    # the AR engine's mixed-step pairs captured lazily unless named
    assert resolve(load_profile("default"), cfg, cpu).engine.mixed_graph_precapture == ()
    named = resolve(load_profile("default", ["ar.mixed_graph_precapture=[[32, 1024], [64, 2048]]"]), cfg, cpu)
    assert named.engine.mixed_graph_precapture == ((32, 1024), (64, 2048))
    assert err("default", ["ar.mixed_graph_precapture=[[0, 1024]]"]).endswith(
        "ar.mixed_graph_precapture: must be a list of [rows, tokens] pairs >= 1, got ((0, 1024),)")
    assert "needs ar.mixed_prefill=true" in err("default", ["ar.mixed_prefill=false", "ar.mixed_graph_precapture=[[32, 1024]]"])
    # launches of up to 4 prompts replay graphs unless told otherwise
    assert f.graph_rows == 4
    assert resolve(load_profile("default", ["frontend.graph_rows=64"]), cfg, cpu).frontend.graph_rows == 64
    assert err("default", ["frontend.graph_rows=-1"]).endswith("frontend.graph_rows: must be >= 0, got -1")
    # prompt audio in the workers' threads unless helper processes are asked for
    assert f.audio_processes is False
    assert resolve(load_profile("default", ["frontend.audio=process"]), cfg, cpu).frontend.audio_processes is True
    assert err("default", ["frontend.audio=auto"]) == ("--set frontend.audio=auto: frontend.audio: "
                                                       "expected one of 'thread', 'process', got str 'auto'")
    codec = lambda *kv: resolve(load_profile("default", list(kv)), cfg, cpu).codec  # noqa: E731
    cuda_codec = lambda *kv: resolve(load_profile("default", list(kv)), cfg, torch.device("cuda")).codec  # noqa: E731
    # whole responses: HiFT eager on exact windows; a bucket is still taken on CUDA when asked
    assert cuda_codec().hift_graph_options() is None and cuda_codec().hift_frame_bucket is None
    assert cuda_codec("optimizations.hift_frame_bucket=32").hift_frame_bucket == 32
    assert codec().hift_frame_bucket is None


def test_gemm_sm_carveout_reaches_cublas_on_cuda_only(monkeypatch):
    """``scheduler.gemm_sm_carveout`` (design.md D35): off by default; on CUDA it becomes the
    process's cuBLAS SM carveout, set with the other process-wide switches; a CPU run ignores it."""
    import torch

    from cosybatch.gpu import runtime
    from cosybatch.models.config import ModelConfig
    from cosybatch.profiles.resolve import resolve

    cfg, cuda, cpu = ModelConfig(), torch.device("cuda"), torch.device("cpu")
    assert resolve(load_profile("default"), cfg, cuda).process.gemm_sm_carveout is None
    on = load_profile("packed_streaming", ["scheduler.gemm_sm_carveout=8"])
    assert resolve(on, cfg, cuda).process.gemm_sm_carveout == 8
    assert resolve(on, cfg, cpu).process.gemm_sm_carveout is None
    assert err("default", ["scheduler.gemm_sm_carveout=0"]) == \
        "--set scheduler.gemm_sm_carveout=0: scheduler.gemm_sm_carveout: must be from 1 to 64 or null, got 0"
    calls = []
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", calls.append, raising=False)
    runtime.apply_process_settings(runtime.ProcessSettings())
    runtime.apply_process_settings(resolve(on, cfg, cuda).process)
    assert calls == [8]
