"""The compiled Triton attention kernel on CUDA, bf16, against a float32 reference.

The bound is measured, not fixed: FlashAttention's varlen kernel (``varlen``) makes the same bf16
roundings (inputs, the probabilities before the second product, the output), so its error on
the same inputs is the spread a correct bf16 kernel has here. A mask one key too long must land
outside it, and a captured CUDA graph must replay the eager result exactly.
"""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from cosybatch.codec.attention import SdpaBackend, TorchVarlenBackend, TritonBackend, make_backend  # noqa: E402
from cosybatch.codec.packing import RowSpec, SubSeqs, pack  # noqa: E402

H, D, CHUNK = 16, 64, 50
# Two kernels with the same roundings but other summation orders land within a small multiple
# of each other's error; a whole key's weight is orders of magnitude more.
SPREAD_FACTOR = 2


def _layout():
    rng = np.random.default_rng(3)
    rows, region = [], 0
    for j in range(12):
        prefix = CHUNK * int(rng.integers(1, 9))
        frames = prefix + int(rng.integers(1, 2 * CHUNK + 1))
        if j % 3 == 2:  # an uncached full-attention row, in the same call
            rows.append(RowSpec(frames, 0, 0, 0))
        else:
            rows.append(RowSpec(frames, prefix, prefix, CHUNK, pool=(region, region + frames)))
            region += 2 * frames
    return pack(rows, conv_gap=30), region


def _run(backend, seqs, q, k, v, n, bases=None):
    meta = backend.prepare(seqs, n, "cuda")
    keys = None if bases is None else backend.layer_keys(meta, bases)[-1]
    return backend.run(q, k, v, meta, keys)


@pytest.mark.parametrize("block_m,merge", [(64, False), (128, True)])
def test_triton_attention_bf16_within_flash_attentions_spread(block_m, merge):
    lay, frames = _layout()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = lay.tokens
    q, k, v = torch.randn(n, 3, H, D, device="cuda", generator=g).to(torch.bfloat16).unbind(1)
    slot = frames + 1
    ak, av = torch.randn(2, 2 * slot, H, D, device="cuda", generator=g).to(torch.bfloat16).unbind(0)
    bases = torch.tensor([0, slot], device="cuda")  # read the second (step, layer) slot
    tri = TritonBackend(block_m=block_m, merge=merge)
    for seqs, kk, vv, b in ((lay.pool, ak, av, bases), (lay.self, k, v, None)):
        cov = torch.zeros(n, dtype=torch.bool, device="cuda")
        for q0, ql in zip(seqs.q_start, seqs.q_len):
            cov[q0 : q0 + ql] = True
        ref = _run(SdpaBackend(), seqs, q.float(), kk.float(), vv.float(), n, b)
        spread = (_run(TorchVarlenBackend(), seqs, q, kk, vv, n, b).float() - ref)[cov].abs().max().item()
        got = _run(tri, seqs, q, kk, vv, n, b)
        assert (got.float() - ref)[cov].abs().max().item() <= SPREAD_FACTOR * spread
        assert torch.count_nonzero(got[~cov]) == 0
        # one key too many for the sub-sequence with the fewest keys (where one key weighs most)
        wrong = SubSeqs(seqs.q_start, seqs.q_len, seqs.k_start, seqs.k_len + (np.arange(len(seqs)) == np.argmin(seqs.k_len)))
        bad = _run(tri, wrong, q, kk, vv, n, b)
        assert (bad.float() - ref)[cov].abs().max().item() > SPREAD_FACTOR * spread


def test_triton_attention_replays_in_a_cuda_graph():
    """The flow captures one Euler step per bucket: the grid is the bucket's, keys move per layer."""
    lay, frames = _layout()
    g = torch.Generator(device="cuda").manual_seed(1)
    n = lay.tokens
    q = torch.randn(n, H, D, device="cuda", generator=g).to(torch.bfloat16)
    ak, av = torch.randn(2, 2 * (frames + 1), H, D, device="cuda", generator=g).to(torch.bfloat16).unbind(0)
    be = make_backend("triton", "cuda")
    meta = be.prepare(lay.pool, n, "cuda", n_seqs=4 * len(lay.pool) + 1, max_q=CHUNK, max_k=15000)
    bases = torch.zeros(1, dtype=torch.long, device="cuda")
    keys = be.layer_keys(meta, bases)
    be.run(q, ak, av, meta, keys[0])  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keys = be.layer_keys(meta, bases)
        out = be.run(q, ak, av, meta, keys[0])
    for base in (0, frames + 1):
        bases.fill_(base)
        graph.replay()
        torch.cuda.synchronize()
        want = be.run(q, ak, av, meta, be.layer_keys(meta, bases)[0])
        assert torch.equal(out, want)

