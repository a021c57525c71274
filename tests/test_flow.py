"""Flow (DiT + CFM + CausalMaskedDiffWithDiT) against the official fixtures."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROWS, load_ref
from cosybatch.models.config import DiTConfig, FlowConfig
from cosybatch.models.dit import DiT, apply_rotary, attention_mask
from cosybatch.models.flow import CausalMaskedDiffWithDiT, PreLookaheadLayer, cfm_noise_table

pytestmark = pytest.mark.numeric

MEL_TOL = 1e-4
DIT_TOL = 1e-5


def _config_from_files(model_dir) -> FlowConfig:
    """FlowConfig from flow.pt shapes + the yaml's chunk numbers (used until a loader exists)."""
    sd = torch.load(model_dir / "flow.pt", weights_only=True)
    yaml_text = (model_dir / "cosyvoice3.yaml").read_text()
    num = lambda key: int(re.search(rf"^{key}:\s*(\d+)", yaml_text, re.M).group(1))  # noqa: E731
    e = "decoder.estimator."
    dim = sd[e + "transformer_blocks.0.attn.to_q.weight"].shape[1]
    dim_head = 2 * sd[e + "rotary_embed.inv_freq"].shape[0]
    heads = sd[e + "transformer_blocks.0.attn.to_q.weight"].shape[0] // dim_head
    depth = len({k.split(".")[3] for k in sd if k.startswith(e + "transformer_blocks.")})
    ff_mult = sd[e + "transformer_blocks.0.ff.ff.0.0.weight"].shape[0] // dim
    ratio = num("token_mel_ratio")
    dit = DiTConfig(dim=dim, depth=depth, heads=heads, dim_head=dim_head, ff_mult=ff_mult, static_chunk_size=num("chunk_size") * ratio)
    return FlowConfig(
        vocab_size=sd["input_embedding.weight"].shape[0],
        spk_embed_dim=sd["spk_embed_affine_layer.weight"].shape[1],
        pre_lookahead_channels=sd["pre_lookahead_layer.conv1.weight"].shape[0],
        pre_lookahead_len=sd["pre_lookahead_layer.conv1.weight"].shape[2] - 1,
        token_mel_ratio=ratio,
        dit=dit,
    )


def _flow_config(model_dir) -> FlowConfig:
    try:
        from cosybatch.checkpoint import load_config
    except ImportError:
        return _config_from_files(model_dir)
    return load_config(model_dir).flow


@pytest.fixture(scope="module")
def flow(model_dir, one_thread):  # one thread for speed; restored after the module
    model = CausalMaskedDiffWithDiT(_flow_config(model_dir))
    sd = torch.load(model_dir / "flow.pt", weights_only=True)
    model.load_state_dict(sd, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def modules(reference_dir):
    return load_file(str(reference_dir / "modules.safetensors"))


def test_state_dict_keys_equal_checkpoint(flow, model_dir):
    sd = torch.load(model_dir / "flow.pt", weights_only=True)
    assert set(flow.state_dict()) == set(sd)
    assert "decoder.estimator.rotary_embed.inv_freq" in flow.state_dict()
    assert "decoder.rand_noise" not in flow.state_dict()
    fresh = DiT(flow.cfg.dit).rotary_embed.inv_freq
    torch.testing.assert_close(fresh, sd["decoder.estimator.rotary_embed.inv_freq"])


def test_noise_table_matches_official_and_spares_global_rng(flow, reference_dir):
    ref = load_file(str(reference_dir / "rng_buffers.safetensors"))["flow.decoder.rand_noise"]
    table = flow.decoder.rand_noise
    assert table.shape == (1, flow.cfg.output_size, flow.cfg.noise_len)
    assert torch.equal(table[:, :, : ref.shape[2]], ref)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    cfm_noise_table(80, 1000)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("streaming,key", [(False, "dit.out_full_mask"), (True, "dit.out_chunk_mask")])
def test_dit_matches_official(flow, modules, streaming, key):
    m = modules
    with torch.no_grad():
        out = flow.decoder.estimator(m["dit.x"], m["dit.mask"], m["dit.mu"], m["dit.t"], m["dit.spks"], m["dit.cond"], streaming=streaming)
    assert out.shape == m[key].shape
    assert (out - m[key]).abs().max().item() <= DIT_TOL


def test_chunk_mask_changes_output(flow, modules):
    # Guard against a chunk mask that silently degenerates to full attention.
    assert (modules["dit.out_full_mask"] - modules["dit.out_chunk_mask"]).abs().max() > 1e-3


def test_cfm_solve_matches_official(flow, modules):
    m = modules
    out = flow.decoder(m["dit.mu"][:1], m["dit.mask"][:1], m["dit.spks"][:1], m["dit.cond"][:1], streaming=False)
    assert out.dtype == torch.float32
    assert (out - m["cfm.out"]).abs().max().item() <= MEL_TOL


def _prompt(ref):
    return ref["frontend.prompt_speech_token"].long(), ref["frontend.prompt_speech_feat"], ref["frontend.embedding"]


@pytest.mark.parametrize("row", ROWS)
def test_nonstream_flow_matches_official(flow, reference_dir, row):
    ref = load_ref(reference_dir, row)
    pt, pf, emb = _prompt(ref)
    seg = 0
    while f"nonstream.seg{seg}.speech_token" in ref:
        tokens = ref[f"nonstream.seg{seg}.speech_token"].long()[None]
        mel = flow.inference(tokens, pt, pf, emb, streaming=False, finalize=True)
        want = ref[f"nonstream.seg{seg}.mel"]
        assert mel.shape == want.shape and mel.dtype == torch.float32
        assert (mel - want).abs().max().item() <= MEL_TOL, (row, seg)
        seg += 1
    assert seg >= 1


@pytest.mark.parametrize("row", ROWS)
def test_stream_chunks_match_official(flow, reference_dir, row):
    ref = load_ref(reference_dir, row)
    meta = json.loads((reference_dir / f"{row}.json").read_text())
    pt, pf, emb = _prompt(ref)
    for c in meta["stream_chunks"]:
        s, ci, final = c["segment"], c["chunk"], c["finalize"]
        tokens = ref[f"stream.seg{s}.speech_token"].long()[None, : c["n_token_in"]]
        mel = flow.inference(tokens, pt, pf, emb, streaming=not final, finalize=final)
        mel = mel[:, :, flow.cfg.token_mel_ratio * c["token_offset"] :]
        want = ref[f"stream.seg{s}.chunk{ci}.mel"]
        assert mel.shape == want.shape, (row, s, ci)
        assert (mel - want).abs().max().item() <= MEL_TOL, (row, s, ci)


def test_prelookahead_context_equals_truncated_final():
    torch.manual_seed(0)
    layer = PreLookaheadLayer(6, 10, 3).eval()
    emb = torch.randn(2, 17, 6)
    with torch.no_grad():
        final = layer(emb)
        partial = layer(emb[:, :-3], context=emb[:, -3:])
    assert partial.shape == (2, 14, 6)
    torch.testing.assert_close(partial, final[:, :14], rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
def test_attention_mask_matches_official_definition(chunk):
    T = 23
    lengths = [23, 15]
    pad = torch.zeros(2, 1, T)
    for b, n in enumerate(lengths):
        pad[b, 0, :n] = 1
    got = attention_mask(pad, chunk)
    assert got.shape == (2, 1, T, T)
    for b, n in enumerate(lengths):
        for i in range(T):
            end = min((i // chunk + 1) * chunk, T)
            want = torch.zeros(T, dtype=torch.bool)
            want[: min(end, n)] = True
            if not want.any():
                want[:] = True
            assert torch.equal(got[b, 0, i], want)
    full = attention_mask(pad, None)
    assert torch.equal(full[1, 0, 0], pad[1, 0].bool()) and torch.equal(full[1, 0, -1], pad[1, 0].bool())


def test_rotary_touches_only_head_zero():
    torch.manual_seed(0)
    dh, T = 8, 5
    freqs_base = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
    q = torch.randn(T, 3 * dh)
    ang = torch.arange(T).float()[:, None] * freqs_base  # [T, dh/2]
    out = apply_rotary(q, ang.repeat_interleave(2, dim=-1))
    assert torch.equal(out[:, dh:], q[:, dh:])
    a, b = q[:, :dh:2], q[:, 1:dh:2]  # interleaved pairs (x0,x1), (x2,x3), ...
    want = torch.stack((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()), dim=-1).flatten(-2)
    torch.testing.assert_close(out[:, :dh], want)


def test_padded_batch_matches_single_rows():
    torch.manual_seed(0)
    cfg = DiTConfig(dim=32, depth=2, heads=2, dim_head=16, ff_mult=2, static_chunk_size=6)
    dit = DiT(cfg).eval()
    T, n1 = 20, 13
    x, mu, cond = (torch.randn(2, cfg.mel_dim, T) for _ in range(3))
    spks, t = torch.randn(2, cfg.spk_dim), torch.tensor([0.3, 0.7])
    mask = torch.ones(2, 1, T)
    mask[1, :, n1:] = 0
    for streaming in (False, True):
        with torch.no_grad():
            both = dit(x, mask, mu, t, spks, cond, streaming=streaming)
            row0 = dit(x[:1], mask[:1], mu[:1], t[:1], spks[:1], cond[:1], streaming=streaming)
            row1 = dit(x[1:, :, :n1], mask[1:, :, :n1], mu[1:, :, :n1], t[1:], spks[1:], cond[1:, :, :n1], streaming=streaming)
        torch.testing.assert_close(both[:1], row0, rtol=0, atol=1e-5)
        torch.testing.assert_close(both[1:, :, :n1], row1, rtol=0, atol=1e-5)
