"""Bipartite soft matching (paper §3-4) and token downsampling (ToDo), as pure tensor functions.

A ``MergePlan`` is computed once per block call from the block input and then applied to any tensor of the
same (B, N, ·) layout: before self-attention, cross-attention or the MLP, and undone after them.

Layout of a merged sequence, per batch row: the ``Ns - r`` kept sources first, then the ``Nd`` destinations.
Every original token has one slot in it (its "slot map"), so merging is one ``index_add_`` plus a division
by slot counts, and unmerging is one ``index_select``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


class MergePlan:
    """How the N tokens of one block call map onto N - r merged tokens.

    Attributes:
        slot_index: (B·N,) index dtype; row ``b·N + n`` of the input goes to row ``slot_index[b·N + n]`` of the
            flattened (B·M, C) merged tensor, M = N - r.
        counts: (B·M, 1) float; how many input tokens were averaged into each merged row.
    """

    __slots__ = ("slot_index", "counts", "batch", "tokens", "merged_tokens", "_log_sizes")

    def __init__(self, slot_index: torch.Tensor, counts: torch.Tensor, batch: int, tokens: int,
                 merged_tokens: int) -> None:
        self.slot_index = slot_index
        self.counts = counts
        self.batch = batch
        self.tokens = tokens
        self.merged_tokens = merged_tokens
        self._log_sizes: torch.Tensor | None = None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (B, N, ·) has the batch rows and tokens this plan was made for."""
        return x.dim() == 3 and x.shape[0] == self.batch and x.shape[1] == self.tokens

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, N - r, C): each destination becomes the mean of itself and its sources."""
        b, n, c = x.shape
        summed = x.new_zeros(b * self.merged_tokens, c).index_add_(0, self.slot_index, x.reshape(b * n, c))
        counts = self.counts if self.counts.dtype == x.dtype else self.counts.to(x.dtype)
        return (summed / counts).view(b, self.merged_tokens, c)

    def key_log_sizes(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, N - r) log of the tokens each merged row stands for: added to its logit as a key, it weighs the
        row in softmax as if its tokens were there one by one (proportional attention). Made once per plan."""
        if self._log_sizes is None or self._log_sizes.dtype != dtype:
            self._log_sizes = self.counts.to(dtype).log().view(self.batch, self.merged_tokens)
        return self._log_sizes

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N - r, C) -> (B, N, C): every merged source takes its destination's value."""
        b, m, c = x.shape
        return x.reshape(b * m, c).index_select(0, self.slot_index).view(b, self.tokens, c)


def _flat(index: torch.Tensor, width: int) -> torch.Tensor:
    """Positions (B, K) within each row of a (B, width) layout -> positions (B·K,) in its flattened rows."""
    return (index + _row_offsets(index.shape[0], width, index.dtype, index.device)).reshape(-1)


# Cached small index tensors: on a GPU a U-Net step at 512-1024 px waits on the host, and every tensor op a
# block call makes costs microseconds of host time, so the ones that never change are made once.
@lru_cache(maxsize=256)
def _row_offsets(batch: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(B, 1): the first flat position of each row of a (B, width) layout."""
    return torch.arange(0, batch * width, width, dtype=dtype, device=device)[:, None]


@lru_cache(maxsize=256)
def _arange(start: int, stop: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(start, stop, dtype=dtype, device=device)


def _rows(x: torch.Tensor, flat_positions: torch.Tensor) -> torch.Tensor:
    """x (B, N, C), the flat positions (B·K,) of K rows per batch row (``_flat``) -> those rows (B, K, C).

    One flat ``index_select`` over B·N rows: about twice as fast on the CPU as selecting along dimension 1.
    """
    b, n, c = x.shape
    return x.reshape(b * n, c).index_select(0, flat_positions).view(b, -1, c)


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (B, M), index (B, K) -> values[b, index[b, k]] (B, K), through a flat ``index_select``.

    Avoids ``gather``, whose last-dimension-1 case MPS mishandles.
    """
    return values.reshape(-1).index_select(0, _flat(index, values.shape[1])).view(index.shape)


def _put(target: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    """target[b, index[b, k]] = values[b, k] in place, for target (B, M), values (B, K) and the flat positions
    (B·K,) of index (B, K) in target (``_flat``)."""
    target.view(-1).index_put_((flat_index,), values.reshape(-1))


def best_destinations(a: torch.Tensor, b: torch.Tensor, chunk_elements: int):
    """For each source row of ``a`` (B, Ns, C) its most similar row of ``b`` (B, Nd, C), by dot product.

    The (B, Ns, Nd) score matrix is never held whole: rows are scored in chunks of at most
    ``chunk_elements`` scores, so the extra memory is bounded by the chunk, not by Ns·Nd.

    Returns:
        best score (B, Ns) and the index of the best destination (B, Ns), int64.
    """
    batch, ns, _ = a.shape
    nd = b.shape[1]
    bt = b.transpose(1, 2)
    rows = max(1, chunk_elements // max(1, batch * nd))
    if rows >= ns:
        return torch.bmm(a, bt).max(dim=-1)
    best = a.new_empty(batch, ns)
    where = torch.empty(batch, ns, dtype=torch.int64, device=a.device)
    for start in range(0, ns, rows):
        stop = min(ns, start + rows)
        best[:, start:stop], where[:, start:stop] = torch.bmm(a[:, start:stop], bt).max(dim=-1)
    return best, where


def plan_merge(metric: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, r: int,
               chunk_elements: int = 1 << 22) -> MergePlan | None:
    """Bipartite soft matching: merge the ``r`` sources most similar to some destination.

    Args:
        metric: (B, N, C) the block input; similarity is the cosine of its rows.
        src, dst: (Ns,), (Nd,) token positions from ``partition``; their dtype is the index dtype used for
            every index operation of the plan.
        r: tokens to remove; capped at Ns. None is returned when nothing can merge (r = 0, or a grid
            smaller than one stride cell, which has no destinations).
    """
    batch, tokens, _ = metric.shape
    ns, nd = src.numel(), dst.numel()
    r = min(int(r), ns)
    if r <= 0 or nd == 0:
        return None
    idt = src.dtype
    with torch.no_grad():
        # Cosine similarity, but only the destinations are normalised before the matmul: a source's norm
        # does not change which destination is best, so it divides the (B, Ns) best scores afterwards.
        # Norms and that division are at least float32 for half-precision tokens too, so the scores that rank
        # the sources carry one rounding (the matmul's) instead of three. The clamp only touches all-zero
        # rows, whose cosine would otherwise be NaN.
        exact = torch.promote_types(metric.dtype, torch.float32)
        norms = torch.linalg.vector_norm(metric, dim=-1, keepdim=True, dtype=exact)
        norms = norms.clamp_min(torch.finfo(exact).tiny)
        src_rows, dst_rows = _flat(src.expand(batch, ns), tokens), _flat(dst.expand(batch, nd), tokens)
        unit_dst = (_rows(metric, dst_rows).to(exact) / _rows(norms, dst_rows)).to(metric.dtype)
        score, best = best_destinations(_rows(metric, src_rows), unit_dst, chunk_elements)
        score = score.to(exact) / _rows(norms, src_rows).squeeze(-1)
        order = score.argsort(dim=-1, descending=True).to(idt)  # (B, Ns): most similar sources first
        best = best.to(idt)
        kept = ns - r
        merged_slots = kept + _take(best, order[:, :r])  # sources merged into their destination's slot
        kept_slots = _arange(0, kept, idt, metric.device).expand(batch, kept)
        src_slot = torch.empty(batch, ns, dtype=idt, device=metric.device)
        _put(src_slot, _flat(order, ns), torch.cat([merged_slots, kept_slots], dim=1))

        slot = torch.empty(batch, tokens, dtype=idt, device=metric.device)
        _put(slot, src_rows, src_slot)
        _put(slot, dst_rows, _arange(kept, kept + nd, idt, metric.device).expand(batch, nd))

        merged_tokens = kept + nd
        slot_index = _flat(slot, merged_tokens)
        ones = metric.new_ones(batch * tokens, 1)
        counts = metric.new_zeros(batch * merged_tokens, 1).index_add_(0, slot_index, ones)
    return MergePlan(slot_index, counts, batch, tokens, merged_tokens)


def downsample_tokens(x: torch.Tensor, h: int, w: int, factor: int, pool: str) -> torch.Tensor:
    """ToDo's key/value source: (B, h·w, C) -> (B, ceil(h/f)·ceil(w/f), C).

    ``nearest`` keeps the top-left token of each f×f window; ``average`` takes the mean of the window's
    tokens (partial windows at the right and bottom edge average the tokens they hold).
    """
    if factor == 1:
        return x
    b, n, c = x.shape
    grid = x.transpose(1, 2).reshape(b, c, h, w)
    if pool == "nearest":
        grid = grid[:, :, ::factor, ::factor]
    else:
        grid = F.avg_pool2d(grid, factor, stride=factor, ceil_mode=True)
    return grid.flatten(2).transpose(1, 2)
