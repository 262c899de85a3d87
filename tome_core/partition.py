"""Destination/source partitions of a token grid (paper §3: one destination per sy×sx cell).

The random choice is a pure function of (seed, timestep, block), computed on the tensor's own device with
int32 arithmetic whose every intermediate stays below 2**31. That makes it identical on every device and for
both index dtypes, needs no host round trip (the timestep never leaves the device) and uses no integer op
that Apple's MPS backend lacks.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# A prime with _P * _P < 2**31, so products of two residues fit in int32. Cubing permutes the residues
# because gcd(3, _P - 1) == 1: a cheap, invertible, non-linear mixing step.
_P = 46337
_MULT = 31337


def _mix(h, v):
    """One hashing round on ints or int32 tensors; both arguments must lie in [0, _P)."""
    if isinstance(v, torch.Tensor):
        h = torch.add(v, h, alpha=_MULT) % _P  # v + _MULT·h in one operation
    else:
        h = (h * _MULT + v) % _P
    return (h * h % _P) * h % _P


def host_key(seed: int, block_id: int) -> int:
    """Fold the parts of the key known on the host (seed of any size, block index) into one residue."""
    h = 7
    s = seed % (1 << 64)
    for _ in range(5):  # _P ** 5 > 2 ** 64, so all of the seed is folded in
        h = _mix(h, s % _P)
        s //= _P
    return _mix(h, block_id % _P)


def timestep_words(timestep: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """The exact bits of the call's (first) timestep as float32, as an int32 tensor of shape (1,).

    Float bits rather than a rounded value: samplers pass continuous timesteps (999.0, 749.25, ...).
    """
    if timestep is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    if not isinstance(timestep, torch.Tensor):
        timestep = torch.tensor([float(timestep)], device=device)
    t = timestep.reshape(-1)[:1].to(device=device, dtype=torch.float32).contiguous()
    return t.view(torch.int32)


def cell_choices(host: int | torch.Tensor, tbits: torch.Tensor, num_cells: int, cell_size: int) -> torch.Tensor:
    """For each cell, which of its ``cell_size`` positions is the destination: int32 (num_cells,).

    ``host`` may also be an int32 tensor (K,) of keys on ``tbits``' device (the blocks of one U-Net call);
    the result is then (K, num_cells), row k equal to the choices for key k, in one pass of tensor ops.
    """
    lo = torch.remainder(tbits, 32768)
    hi = torch.remainder(torch.div(tbits, 32768, rounding_mode="floor"), _P)
    start = host[:, None] if isinstance(host, torch.Tensor) else torch.full_like(lo, host)
    key = _mix(_mix(start, lo), hi)
    low, high = _cell_words(num_cells, tbits.device)
    v = _mix(_mix(key, low), high)
    v = _mix(v, 1)  # one more round so neighbouring cells decorrelate
    return torch.remainder(v, cell_size)


@lru_cache(maxsize=64)
def _cell_words(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cell numbers 0..n-1 as two residues (n % _P, n // _P), int32 (n,) each."""
    cells = torch.arange(n, dtype=torch.int32, device=device)
    return torch.remainder(cells, _P), torch.div(cells, _P, rounding_mode="floor")


@lru_cache(maxsize=256)
def _grid_layout(h: int, w: int, sx: int, sy: int, device: torch.device):
    """Int32 tensors that do not depend on the random choice: cell origins, each choice's destination and
    source offsets from its cell origin, leftover tokens."""
    hsy, wsx = h // sy, w // sx
    cy = torch.arange(hsy, dtype=torch.int32, device=device)[:, None]
    cx = torch.arange(wsx, dtype=torch.int32, device=device)[None, :]
    origin = (cy * (sy * w) + cx * sx).reshape(-1)
    # Choice c (row-major within the cell) puts the destination at offset (c // sx)·w + c % sx; the sources
    # are the cell's other positions, in row-major order. As tables: one lookup per cell instead of
    # arithmetic per cell on every call.
    in_cell = [(c // sx) * w + c % sx for c in range(sx * sy)]
    dst_offset = torch.tensor(in_cell, dtype=torch.int32, device=device)
    src_offsets = torch.tensor([[o for j, o in enumerate(in_cell) if j != c] for c in range(sx * sy)],
                               dtype=torch.int32, device=device).reshape(sx * sy, max(sx * sy - 1, 0))
    # Tokens right of or below the last whole cell are always sources (the stride need not divide the grid).
    yy = torch.arange(h, dtype=torch.int32, device=device)[:, None]
    xx = torch.arange(w, dtype=torch.int32, device=device)[None, :]
    outside = (yy >= hsy * sy) | (xx >= wsx * sx)
    positions = yy * w + xx
    leftover = positions[outside]
    return origin, dst_offset, src_offsets, leftover


@lru_cache(maxsize=256)
def fixed_partition(h: int, w: int, sx: int, sy: int, device: torch.device, index_dtype: torch.dtype):
    """The partition with the top-left token of every cell as destination (``use_rand=False``)."""
    origin = _grid_layout(h, w, sx, sy, device)[0]
    choice = torch.zeros(origin.numel(), dtype=torch.int32, device=device)
    return partition(h, w, sx, sy, choice, index_dtype)


def partition(h: int, w: int, sx: int, sy: int, choice: torch.Tensor, index_dtype: torch.dtype):
    """Token positions (row-major on the h×w grid) of sources and destinations.

    Args:
        choice: int32 (num_cells,), the destination slot of each cell, row-major within the cell; or
            (K, num_cells) for K partitions at once.
    Returns:
        src (N - num_cells,) and dst (num_cells,), both of ``index_dtype``; (K, ·) each for a (K, ·) choice.
        A cell's sources come in row-major order, skipping its destination; the leftover tokens follow.
    """
    origin, dst_offset, src_offsets, leftover = _grid_layout(h, w, sx, sy, choice.device)
    flat_choice = choice.reshape(-1)
    dst = origin + dst_offset.index_select(0, flat_choice).view(choice.shape)
    src_cells = origin[:, None] + src_offsets.index_select(0, flat_choice).view(*choice.shape, src_offsets.shape[1])
    src = torch.cat([src_cells.flatten(-2), leftover.expand(*choice.shape[:-1], -1)], dim=-1)
    return src.to(index_dtype), dst.to(index_dtype)
