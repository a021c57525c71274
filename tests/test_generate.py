"""Random checkpoint generator: official layout, keys/shapes, loader round trip, ONNX contracts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cosybatch.checkpoint.generate import SIZES, generate_checkpoint, model_config_for

PT_FILES = ("llm.pt", "flow.pt", "hift.pt")


def _load(path):
    return torch.load(str(path), map_location="cpu", weights_only=True)


def _body(yaml_text: str) -> list[str]:
    return [line for line in yaml_text.splitlines() if not line.startswith("#")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return generate_checkpoint(tmp_path_factory.mktemp("tiny0") / "ckpt", size="tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_again(tmp_path_factory):
    return generate_checkpoint(tmp_path_factory.mktemp("tiny0b") / "ckpt", size="tiny", seed=0)


def test_layout(tiny):
    names = {p.relative_to(tiny).as_posix() for p in tiny.rglob("*") if p.is_file()}
    blank = {f"CosyVoice-BlankEN/{n}" for n in ("config.json", "generation_config.json", "merges.txt",
                                                "model.safetensors", "tokenizer_config.json", "vocab.json")}
    assert names == {"cosyvoice3.yaml", "configuration.json", "campplus.onnx", "speech_tokenizer_v3.onnx",
                     *PT_FILES} | blank


def test_tiny_matches_fixture_layout(tiny, model_dir):
    """tiny = the fixture's numbers, so the yaml body and every key/shape must coincide."""
    assert _body((tiny / "cosyvoice3.yaml").read_text()) == _body((model_dir / "cosyvoice3.yaml").read_text())
    for name in PT_FILES:
        ours, ref = _load(tiny / name), _load(model_dir / name)
        assert set(ours) == set(ref), name
        for k in ref:
            assert ours[k].shape == ref[k].shape and ours[k].dtype == ref[k].dtype == torch.float32, k
    ours, ref = _load(tiny / "flow.pt"), _load(model_dir / "flow.pt")
    k = "decoder.estimator.rotary_embed.inv_freq"
    torch.testing.assert_close(ours[k], ref[k], rtol=0, atol=0)
    ref_cfg = json.loads((model_dir / "CosyVoice-BlankEN/config.json").read_text())
    our_cfg = json.loads((tiny / "CosyVoice-BlankEN/config.json").read_text())
    assert our_cfg == ref_cfg | {"transformers_version": our_cfg["transformers_version"]}


def test_loader_round_trip(tiny):
    from cosybatch.checkpoint import load_config, load_models

    assert load_config(tiny) == model_config_for("tiny")
    models = load_models(tiny)
    llm = _load(tiny / "llm.pt")
    emb = llm["llm.model.model.embed_tokens.weight"]
    assert torch.equal(llm["llm.model.lm_head.weight"], emb)
    assert torch.equal(models.llm.backbone.embed_tokens.weight, emb)
    hift = _load(tiny / "hift.pt")
    g = hift["conv_pre.parametrizations.weight.original0"]
    v = hift["conv_pre.parametrizations.weight.original1"]
    torch.testing.assert_close(models.hift.conv_pre.weight, g * v / v.flatten(1).norm(dim=1)[:, None, None])


def test_deterministic_per_seed(tiny, tiny_again, tmp_path):
    for name in PT_FILES:
        a, b = _load(tiny / name), _load(tiny_again / name)
        assert list(a) == list(b)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    for name in ("cosyvoice3.yaml", "campplus.onnx", "speech_tokenizer_v3.onnx",
                 "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt"):
        assert (tiny / name).read_bytes() == (tiny_again / name).read_bytes(), name
    from cosybatch.checkpoint.gen_weights import flow_state_dict
    from cosybatch.checkpoint.onnx_standins import write_onnx_standins

    other = flow_state_dict(model_config_for("tiny"), seed=1)
    k = "decoder.estimator.proj_out.weight"
    assert not torch.equal(_load(tiny / "flow.pt")[k], other[k])
    write_onnx_standins(tmp_path, seed=1)
    assert (tiny / "campplus.onnx").read_bytes() != (tmp_path / "campplus.onnx").read_bytes()


def test_init_statistics(tiny):
    llm, flow, hift = (_load(tiny / n) for n in PT_FILES)
    w = llm["llm.model.model.layers.0.mlp.down_proj.weight"]  # [hidden, intermediate]
    assert abs(w.std().item() * math.sqrt(w.shape[1]) - 1) < 0.15
    assert abs(llm["speech_embedding.weight"].std().item() - 1) < 0.05
    assert abs(flow["input_embedding.weight"].std().item() - 1) < 0.05
    assert llm["llm.model.model.norm.weight"].mean().item() == pytest.approx(1, abs=0.15)
    head = llm["llm_decoder.weight"]
    cfg = model_config_for("tiny").llm
    # only eos stays a live stop row; the other stop rows are shrunk far below the speech rows
    assert head[cfg.eos].norm() > head[: cfg.sos].norm(dim=1).mean()
    assert head[cfg.task_id:].norm(dim=1).mean() < 0.2 * head[: cfg.sos].norm(dim=1).mean()
    g = hift["resblocks.0.convs1.0.parametrizations.weight.original0"]
    v = hift["resblocks.0.convs1.0.parametrizations.weight.original1"]
    assert g.shape == (v.shape[0], 1, 1)
    torch.testing.assert_close(g.flatten(), v.flatten(1).norm(dim=1) / math.sqrt(v[0].numel()))


def test_chunk_size_override(tmp_path):
    from cosybatch.checkpoint import load_config

    d = generate_checkpoint(tmp_path / "c7", size="tiny", seed=3, chunk_size=7)
    text = (d / "cosyvoice3.yaml").read_text()
    assert "\nchunk_size: 7 " in text
    cfg = load_config(d)
    assert cfg.chunk_size == 7 and cfg.flow.dit.static_chunk_size == 14
    with pytest.raises(ValueError):
        model_config_for("tiny", chunk_size=0)
    with pytest.raises(ValueError):
        model_config_for("huge")


def test_tokenizer_ids(tiny):
    from cosybatch.text.tokenizer import ENDOFPROMPT_ID, CosyVoice3Tokenizer

    vocab = json.loads((tiny / "CosyVoice-BlankEN/vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 151643 and sorted(vocab.values()) == list(range(151643))
    tok = CosyVoice3Tokenizer.from_dir(tiny / "CosyVoice-BlankEN")
    text = "You are a helpful assistant.<|endofprompt|>The quick brown fox, 42 times!"
    ids = tok.encode(text)
    assert ids.count(ENDOFPROMPT_ID) == 1 == ids.count(151646)
    assert tok.token_to_id("<|endoftext|>") == 151643 and tok.token_to_id("<|im_end|>") == 151645
    assert all(i < 151643 for i in ids if i != ENDOFPROMPT_ID)
    assert len(ids) < len(text) // 2  # the learned merges do compress English
    assert tok.decode(ids, skip_special_tokens=False) == text
    # padding entries are never produced, not even for non-ASCII text
    merges_end = 256 + len((tiny / "CosyVoice-BlankEN/merges.txt").read_text().splitlines()) - 1
    assert max(tok.encode("Grüße, 你好 — ½ ✓ naïve café")) < merges_end


def test_onnx_contract(tiny):
    import onnx
    import onnxruntime as ort

    opts = dict(providers=["CPUExecutionProvider"])
    for name in ("speech_tokenizer_v3.onnx", "campplus.onnx"):
        m = onnx.load(str(tiny / name))
        # opset 16 like the official speech_tokenizer_v3.onnx (LayerNorm exported decomposed)
        assert m.ir_version == 8 and [(o.domain, o.version) for o in m.opset_import] == [("", 16)]
    st = ort.InferenceSession(str(tiny / "speech_tokenizer_v3.onnx"), **opts)
    inputs = [(i.name, i.type) for i in st.get_inputs()]
    assert inputs == [("feats", "tensor(float)"), ("feats_length", "tensor(int32)")]
    assert [(o.name, o.type) for o in st.get_outputs()] == [("indices", "tensor(int32)")]
    rng = np.random.default_rng(0)
    for t in (1, 4, 5, 317):
        feats = (rng.standard_normal((1, 128, t)) * 0.5 - 0.3).astype(np.float32)
        out = st.run(None, {"feats": feats, "feats_length": np.array([t], np.int32)})[0]
        assert out.dtype == np.int32 and out.shape == (1, math.ceil(t / 4))
        assert out.min() >= 0 and out.max() < 6561
    assert len(np.unique(out)) > 20  # varied codes, not a constant
    pair = {"feats": np.concatenate([feats, feats]), "feats_length": np.array([317, 317], np.int32)}
    batch = st.run(None, pair)[0]
    assert batch.shape == (2, 80) and np.array_equal(batch[0], out[0])

    cp = ort.InferenceSession(str(tiny / "campplus.onnx"), **opts)
    assert [(i.name, i.type) for i in cp.get_inputs()] == [("input", "tensor(float)")]
    assert cp.get_outputs()[0].type == "tensor(float)"
    x = rng.standard_normal((2, 150, 80)).astype(np.float32)
    emb = cp.run(None, {"input": x})[0]
    assert emb.shape == (2, 192) and np.isfinite(emb).all()
    assert not np.allclose(emb[0], emb[1])


def test_small_runs_sanely(tmp_path):
    """small: loads, and flow + HiFT give finite, unclipped output on random inputs."""
    from cosybatch.checkpoint import load_models

    d = generate_checkpoint(tmp_path / "small", size="small", seed=0)
    m = load_models(d)
    assert m.cfg.llm.sampling.top_k == SIZES["small"].sampling.top_k == 25
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 6561, (1, 12), generator=g)
    ptok = torch.randint(0, 6561, (1, 6), generator=g)
    with torch.inference_mode():
        prompt_mel, spk = torch.randn(1, 12, 80, generator=g), torch.randn(1, 192, generator=g)
        mel = m.flow.inference(tok, ptok, prompt_mel, spk, streaming=False, finalize=True)
        wav, _ = m.hift.inference(mel, finalize=True)
    assert mel.shape == (1, 80, 24) and torch.isfinite(mel).all()
    assert torch.isfinite(wav).all() and (wav.abs() >= 0.99).float().mean() < 0.05
    assert 0.01 < wav.pow(2).mean().sqrt() < 0.6


def test_full_size_keys_match_official_counts():
    """Keys/shapes for `full` come from meta-device modules: check the spec's official counts."""
    from cosybatch.checkpoint import gen_weights as gw
    from cosybatch.models.flow import CausalMaskedDiffWithDiT
    from cosybatch.models.hift import CausalHiFTGenerator
    from cosybatch.models.speech_lm import CosyVoice3LM

    cfg = model_config_for("full")
    llm = gw._entry_kinds(gw._build(lambda: CosyVoice3LM(cfg.llm)))
    assert len(llm) + 1 == 293  # + the tied lm_head duplicate
    assert sum(math.prod(s) for _, s in llm.values()) + 151936 * 896 == 642_283_136
    flow = gw._entry_kinds(gw._build(lambda: CausalMaskedDiffWithDiT(cfg.flow)))
    assert len(flow) == 330 and flow["decoder.estimator.rotary_embed.inv_freq"] == ("buffer", (32,))
    hift = gw._entry_kinds(gw._build(lambda: CausalHiFTGenerator(cfg.hift)))
    wn = [s for k, (_, s) in hift.items() if k.endswith(".weight") and gw._HIFT_WN.match(k.rsplit(".", 1)[0])]
    assert len(hift) + len(wn) == 328  # each weight-normed weight becomes original0 (g) + original1 (v)
    assert sum(math.prod(s) for _, s in hift.values()) + sum(s[0] for s in wn) == 20_779_887
