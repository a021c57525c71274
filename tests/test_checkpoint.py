import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from cosybatch.checkpoint import (
    CheckpointError,
    HyperYamlError,
    YamlObject,
    flow_state_dict,
    fold_weight_norm,
    hift_state_dict,
    llm_state_dict,
    load_config,
    load_models,
    parse_hyperyaml,
    read_state_dict,
    resolve_model_dir,
    strict_load,
)
from cosybatch.models.config import DiTConfig, ModelConfig

# Official Qwen2-0.5B numbers (CosyVoice-BlankEN/config.json of the real checkpoint).
OFFICIAL_QWEN = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_scaling": None, "use_sliding_window": False,
}  # fmt: skip


# ------------------------------------------------------------------ hyperyaml -------------


def test_hyperyaml_tags_refs_and_arithmetic():
    conf = parse_hyperyaml(
        """
__seed: !apply:builtins.exit [3]
a: 25
b: 2
lr: 1e-5
neg: -2.5E+3
name: 'base'
nested: {inner: {x: 7}}
prod: !ref <a> * <b>
mix: !ref (<a> + 1) // <b> - <nested.inner.x>
brackets: !ref <nested[inner][x]>
path: !ref <name>/file.txt
tup: !tuple (1, 2)
obj: !new:pkg.mod.Cls
    size: !ref <a>
    child: !new:pkg.Other [1, 2]
    fn: !name:pkg.fn
same: !ref <obj>
dup: !copy <obj>
"""
    )
    assert isinstance(conf["__seed"], YamlObject) and conf["__seed"].tag == "apply"  # recorded, not run
    assert conf["__seed"].target == "builtins.exit" and conf["__seed"].args == [3]
    assert conf["lr"] == 1e-5 and isinstance(conf["lr"], float) and conf["neg"] == -2500.0
    assert conf["prod"] == 50 and isinstance(conf["prod"], int)
    assert conf["mix"] == 13 - 7
    assert conf["brackets"] == 7
    assert conf["path"] == "base/file.txt"
    obj = conf["obj"]
    assert (obj.tag, obj.target, obj.class_name, obj["size"]) == ("new", "pkg.mod.Cls", "Cls", 25)
    assert obj["child"].args == [1, 2] and obj["fn"].tag == "name" and obj["fn"].kwargs == {}
    assert conf["same"] is obj and conf["dup"] == obj and conf["dup"] is not obj


def test_hyperyaml_overrides_and_errors():
    conf = parse_hyperyaml("p: ''\nq: !ref <p>/x\n", overrides={"p": "/models/BlankEN"})
    assert conf["q"] == "/models/BlankEN/x"
    with pytest.raises(HyperYamlError, match="no key 'missing'"):
        parse_hyperyaml("a: !ref <missing>\n")
    with pytest.raises(HyperYamlError, match="circular"):
        parse_hyperyaml("a: !ref <b>\nb: !ref <a>\n")
    with pytest.raises(HyperYamlError):
        parse_hyperyaml("a: [1, 2\n")


# ------------------------------------------------------------------ config ----------------


def test_load_config_fixture(model_dir):
    cfg = load_config(model_dir)
    q = cfg.llm.qwen
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads) == (12, 2, 2, 1)
    assert (q.intermediate_size, q.vocab_size, q.rope_theta) == (32, 151936, 1e6)
    assert (cfg.llm.llm_input_size, cfg.llm.llm_output_size, cfg.llm.speech_token_size) == (12, 12, 6561)
    s = cfg.llm.sampling
    assert (s.top_p, s.top_k, s.win_size, s.tau_r) == (0.8, 1, 10, 2.0)
    d = cfg.flow.dit
    assert (d.dim, d.depth, d.heads, d.dim_head, d.ff_mult, d.static_chunk_size) == (32, 2, 2, 16, 2, 50)
    assert (cfg.flow.pre_lookahead_channels, cfg.flow.pre_lookahead_len, cfg.flow.token_mel_ratio) == (32, 3, 2)
    assert cfg.flow.sigma_min == 1e-6 and cfg.flow.inference_cfg_rate == 0.7
    assert (cfg.hift.base_channels, cfg.hift.f0_cond_channels, cfg.hift.n_fft, cfg.hift.hop_len) == (32, 16, 16, 4)
    assert cfg.hift.resblock_dilation_sizes == ((1, 3, 5),) * 3 and cfg.hift.samples_per_frame == 480
    assert (cfg.mel.n_fft, cfg.mel.hop_size, cfg.mel.fmax, cfg.mel.center) == (1920, 480, None, False)
    assert (cfg.sample_rate, cfg.token_frame_rate, cfg.chunk_size) == (24000, 25, 25)


def _official_dir(model_dir: Path, dst: Path, chunk_size: int = 25) -> Path:
    """The fixture yaml with the README's numeric changes undone = the official yaml."""
    text = (model_dir / "cosyvoice3.yaml").read_text()
    for pattern, value in [
        (r"^llm_input_size: \d+", "llm_input_size: 896"),
        (r"^llm_output_size: \d+", "llm_output_size: 896"),
        (r"^chunk_size: \d+", f"chunk_size: {chunk_size}"),
        (r"^        channels: \d+", "        channels: 1024"),
        (r"^            dim: \d+", "            dim: 1024"),
        (r"^            depth: \d+", "            depth: 22"),
        (r"^            heads: \d+", "            heads: 16"),
        (r"^            dim_head: \d+", "            dim_head: 64"),
        (r"^    base_channels: \d+", "    base_channels: 512"),
        (r"^        cond_channels: \d+", "        cond_channels: 512"),
        (r"^        top_k: \d+", "        top_k: 25"),
        (r"^        tau_r: [\d.]+", "        tau_r: 0.1"),
    ]:
        text, n = re.subn(pattern, value, text, flags=re.M)
        assert n == 1, pattern
    (dst / "CosyVoice-BlankEN").mkdir(parents=True)
    (dst / "cosyvoice3.yaml").write_text(text)
    (dst / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(OFFICIAL_QWEN))
    return dst


def test_load_config_official_yaml_gives_official_numbers(model_dir, tmp_path):
    assert load_config(_official_dir(model_dir, tmp_path / "full")) == ModelConfig()
    other = load_config(_official_dir(model_dir, tmp_path / "c10", chunk_size=10))
    assert other.chunk_size == 10 and other.flow.dit.static_chunk_size == 20


def test_load_config_errors(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="cosyvoice3.yaml"):
        load_config(tmp_path)
    d = _official_dir(model_dir, tmp_path / "cv2")
    yaml_path = d / "cosyvoice3.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("llm.llm.CosyVoice3LM", "llm.llm.Qwen2LM"))
    with pytest.raises(CheckpointError, match="expected CosyVoice3LM"):
        load_config(d)
    (d / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps({**OFFICIAL_QWEN, "hidden_size": 64}))
    yaml_path.write_text(yaml_path.read_text().replace("llm.llm.Qwen2LM", "llm.llm.CosyVoice3LM"))
    with pytest.raises(CheckpointError, match="hidden_size 64"):
        load_config(d)


# ------------------------------------------------------------------ state dicts -----------


def test_llm_and_flow_key_maps(model_dir):
    raw = read_state_dict(model_dir / "llm.pt")
    sd = llm_state_dict(raw)
    assert len(raw) == 29 and len(sd) == 28 and "llm.model.lm_head.weight" not in sd
    assert sum(k.startswith("backbone.") for k in sd) == 26
    assert {k for k in sd if not k.startswith("backbone.")} == {"llm_decoder.weight", "speech_embedding.weight"}
    assert sd["backbone.embed_tokens.weight"] is raw["llm.model.model.embed_tokens.weight"]
    flow = flow_state_dict(read_state_dict(model_dir / "flow.pt"))
    assert len(flow) == 50 and "decoder.estimator.rotary_embed.inv_freq" in flow


@pytest.mark.numeric
def test_hift_fold_matches_fixture_construction(model_dir):
    raw = read_state_dict(model_dir / "hift.pt")
    pairs = [k[: -len(".parametrizations.weight.original0")] for k in raw if k.endswith("original0")]
    sd = hift_state_dict({"generator." + k: v for k, v in raw.items()})  # wrapper prefix is stripped
    assert len(raw) == 328 and len(sd) == 328 - len(pairs)
    assert not any("parametrizations" in k or "generator" in k for k in sd)
    for base in pairs:
        g = raw[base + ".parametrizations.weight.original0"]
        v = raw[base + ".parametrizations.weight.original1"]
        w = sd[base + ".weight"]
        assert w.shape == v.shape
        want_dtype = torch.float64 if base.startswith("f0_predictor.") else torch.float32
        assert w.dtype == want_dtype
        # each output row of the folded weight has norm |g|
        torch.testing.assert_close(w.flatten(1).norm(dim=1), g.flatten().to(want_dtype).abs())


@pytest.mark.numeric
def test_fold_is_bit_identical_to_torch_weight_norm():
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(6, 5, 3))
    with torch.no_grad():
        conv.parametrizations.weight.original0.mul_(torch.rand(5, 1, 1) + 0.5)
    sd = conv.state_dict()
    folded = fold_weight_norm(sd)
    assert set(folded) == {"weight", "bias"}
    assert torch.equal(folded["weight"], conv.weight.detach())
    # the old weight_g / weight_v layout folds the same way
    old = {"weight_g": sd["parametrizations.weight.original0"], "weight_v": sd["parametrizations.weight.original1"]}
    assert torch.equal(fold_weight_norm(old)["weight"], conv.weight.detach())
    # float64 folding reproduces a module converted to float64 before the weight is computed
    conv64 = conv.to(torch.float64)
    f64 = fold_weight_norm({"f0." + k: v for k, v in sd.items()}, float64_prefixes=("f0.",))
    assert torch.equal(f64["f0.weight"], conv64.weight.detach())
    # a lone half is passed through for the strict loader to report
    assert set(fold_weight_norm({"x.parametrizations.weight.original1": sd["parametrizations.weight.original1"]})) == {
        "x.parametrizations.weight.original1"
    }


class _Dummy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Embedding(5, 2)
        self.register_buffer("persist", torch.zeros(2))


def test_strict_load_reports_everything():
    m = _Dummy()
    good = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    strict_load(m, good, "dummy.pt")
    assert torch.equal(m.a.weight, good["a.weight"])
    bad = dict(good)
    del bad["a.bias"], bad["persist"]
    bad["extra.weight"] = torch.zeros(1)
    bad["b.weight"] = torch.zeros(6, 2)
    with pytest.raises(CheckpointError) as e:
        strict_load(m, bad, "/ckpt/dummy.pt")
    msg = str(e.value)
    assert msg.startswith("/ckpt/dummy.pt")
    for needle in ("a.bias", "persist", "extra.weight", "b.weight: file (6, 2) vs model (5, 2)", "missing keys (2)"):
        assert needle in msg


def test_read_state_dict_errors(tmp_path):
    with pytest.raises(CheckpointError, match="flow.pt: file not found"):
        read_state_dict(tmp_path / "flow.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt"):
        read_state_dict(tmp_path / "junk.pt")


# ------------------------------------------------------------------ load_models -----------


def test_load_models_fixture(model_dir):
    m = load_models(model_dir)
    assert m.cfg == load_config(model_dir)
    assert not (m.llm.training or m.flow.training or m.hift.training)
    raw = read_state_dict(model_dir / "llm.pt")
    assert torch.equal(m.llm.backbone.embed_tokens.weight, raw["llm.model.model.embed_tokens.weight"])
    assert torch.equal(m.llm.llm_decoder.weight, raw["llm_decoder.weight"])
    hift = read_state_dict(model_dir / "hift.pt")
    assert torch.equal(m.hift.m_source.l_linear.weight, hift["m_source.l_linear.weight"])


def test_load_models_skips_the_random_fill_and_restores_torch_init(model_dir, monkeypatch):
    """Modules are built without the random parameter fill that strict_load overwrites: the
    fill functions are not called while building, are restored afterwards, and every
    parameter still equals the file's (tested above for a few)."""
    import cosybatch.checkpoint.loader as loader

    calls = []
    real = torch.nn.init.kaiming_uniform_
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", lambda t, *a, **k: calls.append(t.shape) or real(t, *a, **k))
    m = loader.load_models(model_dir)
    assert calls == []
    assert torch.nn.init.kaiming_uniform_ is not real  # the test's wrapper, put back as it was
    torch.nn.Linear(4, 4)
    assert calls == [(4, 4)]
    raw = loader.flow_state_dict(read_state_dict(model_dir / "flow.pt"))
    for name, p in m.flow.named_parameters():
        assert torch.equal(p, raw[name]), name


def test_load_models_missing_file(model_dir, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    for p in model_dir.iterdir():
        if p.name != "flow.pt":
            (d / p.name).symlink_to(p)
    with pytest.raises(CheckpointError, match=r"flow\.pt: file not found"):
        load_models(d)


# ------------------------------------------------------------------ resolve ---------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "MODELSCOPE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def _snapshot(root: Path, repo: str, rev: str) -> Path:
    snap = root / ("models--" + repo.replace("/", "--")) / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "cosyvoice3.yaml").write_text("x: 1\n")
    return snap


def test_resolve_local_dir(model_dir, clean_env):
    assert resolve_model_dir(str(model_dir)) == model_dir.resolve()
    with pytest.raises(CheckpointError, match="cosyvoice3.yaml is missing"):
        resolve_model_dir(str(model_dir / "CosyVoice-BlankEN"))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_dir(str(clean_env / "nope" / "deeper" / "dir"))


def test_resolve_hf_cache_prefers_refs_main(clean_env, monkeypatch):
    cache = clean_env / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    repo = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
    main = _snapshot(cache, repo, "aaa111")
    (main.parent.parent / "refs").mkdir()
    (main.parent.parent / "refs" / "main").write_text("aaa111\n")
    _snapshot(cache, repo, "zzz999")  # newer, but not what refs/main points to
    assert resolve_model_dir(repo) == main.resolve()
    assert resolve_model_dir(None) == main.resolve()  # the default repo


def test_resolve_hf_home_and_modelscope(clean_env, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(clean_env / "hfhome"))
    snap = _snapshot(clean_env / "hfhome" / "hub", "Org/Model", "r1")
    assert resolve_model_dir("Org/Model") == snap.resolve()
    ms = clean_env / "home" / ".cache" / "modelscope" / "hub" / "Org" / "Other___1"
    ms.mkdir(parents=True)
    (ms / "cosyvoice3.yaml").write_text("x: 1\n")
    assert resolve_model_dir("Org/Other.1") == ms.resolve()


def test_resolve_not_found_explains_download(clean_env):
    with pytest.raises(CheckpointError) as e:
        resolve_model_dir("FunAudioLLM/Fun-CosyVoice3-0.5B-2512")
    msg = str(e.value)
    assert "huggingface-cli download FunAudioLLM/Fun-CosyVoice3-0.5B-2512 --local-dir" in msg
    assert "models--FunAudioLLM--Fun-CosyVoice3-0.5B-2512" in msg


def test_default_dit_config_is_official():
    # guards the equality test above against silently comparing two wrong configs
    assert DiTConfig().static_chunk_size == 50 and ModelConfig().llm.qwen.hidden_size == 896

