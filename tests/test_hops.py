import json

import pytest

from cosybatch.hops import HopSchedule, SegmentPlanner, plan_segment
from conftest import ROWS


@pytest.mark.numeric
@pytest.mark.parametrize("row", ROWS)
def test_schedule_matches_official_chunks(reference_dir, row):
    meta = json.loads((reference_dir / f"{row}.json").read_text())
    from conftest import load_ref

    ref = load_ref(reference_dir, row)
    P = ref["frontend.prompt_speech_token"].shape[1]
    schedule = HopSchedule()
    got = []
    for s, n in enumerate(meta["stream_flow_token_counts"]):
        for c in plan_segment(schedule, P, n):
            got.append((s, c.index, c.end, c.offset, c.finalize))
    want = [(c["segment"], c["chunk"], c["n_token_in"], c["token_offset"], c["finalize"]) for c in meta["stream_chunks"]]
    assert got == want


def test_golden_sequence_incremental():
    # 80 prompt tokens: pad 20, so the first chunk needs 25+20+3 tokens; then hops 50, 100, 100.
    sched = HopSchedule()
    p = SegmentPlanner(sched, prompt_tokens=80)
    fired = []
    for n in range(1, 300):
        c = p.next_chunk(n, finished=False)
        if c:
            fired.append((n, c.end, c.offset))
    assert fired == [(48, 48, 0), (98, 98, 45), (198, 198, 95), (298, 298, 195)]
    final = p.next_chunk(310, finished=True)
    assert final.finalize and final.offset == 295 and final.end == 310
    assert p.next_chunk(310, finished=True) is None


def test_hop_persists_across_segments_not_rows():
    sched = HopSchedule()
    plan_segment(sched, 50, 200)
    assert sched.hop == 100
    assert HopSchedule().hop == 25


def test_short_segment_is_one_final_chunk():
    chunks = plan_segment(HopSchedule(), 79, 45)
    assert len(chunks) == 1 and chunks[0].finalize and chunks[0].offset == 0 and chunks[0].end == 45
