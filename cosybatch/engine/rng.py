"""Counter-based random numbers: uniform(seed, step, draw) is a pure function of its arguments.

Each request owns the stream named by its seed; the value for its i-th token and d-th draw never
depends on which rows share the batch, on the device or on any generator state. The mixing is a
32-bit integer hash (xor-shift / multiply rounds) evaluated with int64 tensor ops. Every
multiplier is below 2**31, so no product of a 32-bit value overflows int64 and the low 32 bits
are exact on every backend.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# odd multipliers < 2**31 (products with 32-bit values stay below 2**62)
_C1 = 0x2C1B3C6D
_C2 = 0x297A2D39
_GOLD = 0x1E3779B9  # additive stream separator
_SALT = 0x5BD1E995  # draw 0's word (draw_salt)


def _mix(x: torch.Tensor) -> torch.Tensor:
    for c in (_C1, _C2, _C1):
        x = x ^ (x >> 16)
        x = (x * c) & _M32
    return x ^ (x >> 15)


def split_seed(seed: int) -> tuple[int, int]:
    """Seed (0 <= seed < 2**63) -> (low, high) 32-bit words, as stored per row."""
    return seed & _M32, (seed >> 32) & _M32


def hash32(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, draw: int) -> torch.Tensor:
    """int64 tensors (broadcastable) -> int64 values in [0, 2**32)."""
    h = _mix((step & _M32) ^ draw_salt(draw))
    h = _mix(h ^ seed_hi)
    h = _mix((h + _GOLD) & _M32 ^ seed_lo)
    return h


def draw_salt(draw: int) -> int:
    """The 32-bit word that separates draw ``draw``'s hash from the others'."""
    return (draw * _GOLD + _SALT) & _M32


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, draws: int) -> torch.Tensor:
    """[n] int64 each -> [n, draws] float64: ``uniform`` for draws 0..draws-1 (the torch form of
    ``engine.triton_kernels.uniforms``, which gives the same bits in one launch)."""
    return torch.stack([uniform(seed_lo, seed_hi, step, d) for d in range(draws)], 1)


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, draw: int) -> torch.Tensor:
    """float64 uniforms in [0, 1) with 53 random bits, from two decorrelated 32-bit hashes."""
    a = hash32(seed_lo, seed_hi, step, 2 * draw) >> 5  # 27 bits
    b = hash32(seed_lo, seed_hi, step, 2 * draw + 1) >> 6  # 26 bits
    return ((a << 26) + b).double() * (1.0 / 9007199254740992.0)  # / 2**53
