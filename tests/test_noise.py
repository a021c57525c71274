"""Replay of the construction-time RNG tables (design.md D5)."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cosybatch.models.config import FlowConfig, HiFTConfig, ModelConfig
from cosybatch.models import noise

pytestmark = pytest.mark.numeric


def fixture_config(model_dir) -> ModelConfig:
    try:
        from cosybatch.checkpoint.loader import load_config
    except ImportError:  # the loader is someone else's module; the tiny yaml's HiFT changes
        return ModelConfig(hift=HiFTConfig(base_channels=32, f0_cond_channels=16))
    return load_config(model_dir)


@pytest.fixture(scope="module")
def rng_ref(reference_dir):
    return load_file(str(reference_dir / "rng_buffers.safetensors"))


def test_tables_bit_equal_to_fixture(model_dir, rng_ref):
    cfg = fixture_config(model_dir)
    ref_sine = rng_ref["hift.m_source.l_sin_gen.sine_waves"]
    tables = noise.replay_rng_tables(cfg, max_len=ref_sine.shape[1])
    ref_noise = rng_ref["flow.decoder.rand_noise"]
    assert tables.cfm_noise.shape == (1, cfg.flow.output_size, cfg.flow.noise_len)
    assert torch.equal(tables.cfm_noise[:, :, : ref_noise.shape[2]], ref_noise)
    assert torch.equal(tables.rand_ini, rng_ref["hift.m_source.l_sin_gen.rand_ini"])
    assert tables.rand_ini[0, 0] == 0
    assert torch.equal(tables.sine_waves, ref_sine)


def test_global_rng_untouched(model_dir):
    noise.clear_cache()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    noise.replay_rng_tables(fixture_config(model_dir), max_len=1000)
    noise.sine_noise(fixture_config(model_dir), 5000)
    assert torch.equal(torch.get_rng_state(), before)


def test_prefixes_consistent(model_dir):
    cfg = fixture_config(model_dir)
    noise.clear_cache()
    short = noise.replay_rng_tables(cfg, max_len=1234).sine_waves.clone()
    noise.clear_cache()
    long = noise.replay_rng_tables(cfg, max_len=50_000)
    assert torch.equal(long.sine_waves[:, :1234], short)
    # a shorter request is served from the cached longer table
    again = noise.replay_rng_tables(cfg, max_len=1234)
    assert again.sine_waves.data_ptr() == long.sine_waves.data_ptr()
    rand_ini, table = noise.sine_noise(cfg, 777)
    assert table.shape == (1, 777, cfg.hift.nb_harmonics + 1)
    assert torch.equal(table, long.sine_waves[:, :777])
    with pytest.raises(ValueError):
        noise.sine_noise(cfg, cfg.hift.sine_table_len + 1)


def _official_like_construction(cfg: ModelConfig, sine_len: int):
    """Build the real modules in the official order under a forked global RNG."""
    fl, hf = cfg.flow, cfg.hift
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfm = torch.randn(1, fl.output_size, fl.noise_len)
        nn.Embedding(fl.vocab_size, fl.input_size)
        nn.Linear(fl.spk_embed_dim, fl.output_size)
        nn.Conv1d(hf.f0_in_channels, hf.f0_cond_channels, 4)
        for _ in range(4):
            nn.Conv1d(hf.f0_cond_channels, hf.f0_cond_channels, 3)
        nn.Linear(hf.f0_cond_channels, hf.f0_num_class)
        rand_ini = torch.rand(1, hf.nb_harmonics + 1)
        rand_ini[:, 0] = 0
        sine = torch.rand(1, sine_len, hf.nb_harmonics + 1)
    return cfm, rand_ini, sine


@pytest.mark.parametrize("shapes", [
    dict(flow=dict(vocab_size=100, input_size=8, spk_embed_dim=24, output_size=8, noise_len=64),
         hift=dict(f0_in_channels=8, f0_cond_channels=12, nb_harmonics=4, f0_num_class=2)),
    dict(flow=dict(noise_len=300), hift=dict(f0_cond_channels=48, nb_harmonics=8)),
])
def test_replay_matches_module_construction_for_other_shapes(shapes):
    cfg = ModelConfig(flow=replace(FlowConfig(), **shapes["flow"]),
                      hift=replace(HiFTConfig(), **shapes["hift"]))
    cfm, rand_ini, sine = _official_like_construction(cfg, 3000)
    got = noise.replay_rng_tables(cfg, max_len=3000)
    assert torch.equal(got.cfm_noise, cfm)
    assert torch.equal(got.rand_ini, rand_ini)
    assert torch.equal(got.sine_waves, sine)


def test_tables_depend_on_shapes(model_dir):
    cfg = fixture_config(model_dir)
    other = replace(cfg, hift=replace(cfg.hift, f0_cond_channels=cfg.hift.f0_cond_channels + 1))
    a = noise.replay_rng_tables(cfg, max_len=100)
    b = noise.replay_rng_tables(other, max_len=100)
    assert torch.equal(a.cfm_noise, b.cfm_noise)  # drawn before the F0 predictor
    assert not torch.equal(a.rand_ini, b.rand_ini)
