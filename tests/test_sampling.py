import math

import pytest
import torch

from conftest import ROWS, load_ref
from cosybatch.models.config import SamplingConfig
from cosybatch.models.silence import SILENT_TOKENS, SilentFilter, silent_filter
from cosybatch.reference.samplers import (
    nucleus_count,
    nucleus_sampling,
    random_sampling,
    ras_sampling,
    repetition_hit,
)

pytestmark = pytest.mark.numeric


def _logp(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


def test_nucleus_keeps_hand_computed_set():
    # sorted: 0.4 (cum .4) 0.3 (.7) 0.2 (.9, crosses 0.8, still kept) -> stop
    lp = _logp([0.1, 0.4, 0.2, 0.3])
    probs, idx = lp.softmax(0).sort(descending=True, stable=True)
    assert nucleus_count(probs, 0.8, 25) == 3
    assert nucleus_count(probs, 0.8, 2) == 2
    assert nucleus_count(probs, 0.3, 25) == 1  # first alone already crosses top_p
    assert nucleus_count(probs, 1.0, 25) == 4
    g = torch.Generator().manual_seed(0)
    drawn = {nucleus_sampling(lp, 0.8, 25, g) for _ in range(3000)}
    assert drawn == {1, 3, 2}
    drawn = {nucleus_sampling(lp, 0.8, 2, g) for _ in range(3000)}
    assert drawn == {1, 3}


def test_nucleus_top_k_one_is_argmax_lowest_index_on_ties():
    lp = _logp([0.2, 0.3, 0.3, 0.2])
    g = torch.Generator().manual_seed(3)
    assert {nucleus_sampling(lp, 0.8, 1, g) for _ in range(50)} == {1}


def test_nucleus_float32_cumsum_boundary():
    # float32: 0.7f + 0.1f rounds to 0.8f, which is not < float32(0.8): the walk stops at 2.
    # A float64 running sum (0.79999999) would keep a third token.
    sorted_probs = torch.tensor([0.7, 0.1, 0.1, 0.1])
    assert float(sorted_probs[0]) + float(sorted_probs[1]) < 0.8
    assert nucleus_count(sorted_probs, 0.8, 25) == 2
    lp = sorted_probs.log()
    g = torch.Generator().manual_seed(0)
    assert {nucleus_sampling(lp, 0.8, 25, g) for _ in range(500)} == {0, 1}
    g = torch.Generator().manual_seed(0)


def test_ras_fallback_fires_exactly_on_repetition():
    # token 0 is the nucleus pick under top_k=1; token 1 is the only other token with mass
    lp = _logp([0.9, 0.1, 0.0, 0.0])
    cfg = SamplingConfig(top_p=0.8, top_k=1, win_size=4, tau_r=0.5)  # threshold 2 in last 4
    g = torch.Generator().manual_seed(0)
    cases = {
        (): 0,
        (0,): 0,
        (0, 0): 1,
        (0, 5, 0): 1,
        (0, 0, 5, 5, 5): 0,  # the two 0s fell out of the 4-token window
        (0, 5, 5, 0): 1,
        (5, 0, 0, 0, 0): 1,
    }
    for decoded, want in cases.items():
        assert repetition_hit(decoded, 0, cfg.win_size, cfg.tau_r) == (want == 1)
        before = lp.clone()
        for _ in range(20):
            assert ras_sampling(lp, list(decoded), cfg, g) == want
        assert torch.equal(lp, before)  # caller's scores untouched


def test_ras_fallback_uses_full_softmax_not_nucleus():
    # With top_p small, nucleus keeps only id 0; fallback must reach the low-mass tail too.
    probs = [0.6] + [0.4 / 9] * 9
    lp = _logp(probs)
    cfg = SamplingConfig(top_p=0.1, top_k=25, win_size=3, tau_r=1 / 3)
    g = torch.Generator().manual_seed(1)
    drawn = {ras_sampling(lp, [0], cfg, g) for _ in range(2000)}
    assert drawn == set(range(1, 10))


def test_random_sampling_distribution():
    lp = _logp([0.25, 0.75])
    g = torch.Generator().manual_seed(0)
    draws = [random_sampling(lp, g) for _ in range(4000)]
    frac = sum(draws) / len(draws)
    assert abs(frac - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 4000)


def test_silent_filter_hand_made():
    s = sorted(SILENT_TOKENS)
    assert len(s) == 11 and {1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323} == set(s)
    seq = [7, 1, 2, 28, 29, 55, 248, 494, 9, 1, 1]
    assert silent_filter(seq) == [7, 1, 2, 28, 29, 55, 9, 1, 1]
    assert silent_filter([1] * 5) == [1] * 5
    assert silent_filter([2] * 9 + [3] + [2] * 6) == [2] * 5 + [3] + [2] * 5
    assert silent_filter([1, 1, 1], max_run=1) == [1]
    assert silent_filter([]) == []
    f = SilentFilter(max_run=2)
    assert [f.push(t) for t in [1, 2, 28, 4, 1]] == [True, True, False, True, True]


@pytest.mark.parametrize("row", ROWS)
def test_silent_filter_matches_fixture(reference_dir, row):
    ref = load_ref(reference_dir, row)
    seg = 0
    while f"seg{seg}.text_token" in ref:
        for mode in ("nonstream", "stream"):
            raw = ref[f"{mode}.seg{seg}.llm_tokens_raw"].tolist()
            assert silent_filter(raw) == ref[f"{mode}.seg{seg}.speech_token"].tolist()
        seg += 1
    if row == "utt5_paragraph":
        raw = ref["nonstream.seg0.llm_tokens_raw"].tolist()
        assert len(raw) - len(silent_filter(raw)) == 3
