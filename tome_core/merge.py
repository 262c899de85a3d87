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
    # Each chunk's (B, rows) results are small; joining them at the end costs two operations in all, where
    # writing each into a preallocated row range would cost four per chunk.
    parts = [torch.bmm(part, bt).max(dim=-1) for part in a.split(rows, dim=1)]
    return torch.cat([best for best, _ in parts], dim=1), torch.cat([where for _, where in parts], dim=1)


@lru_cache(maxsize=16)
def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 (``torch.promote_types`` is a dispatched operation: looked up once per dtype)."""
    return torch.promote_types(dtype, torch.float32)


class SplitRows:
    """Where one partition's sources and destinations lie in the flattened (B·N, C) rows of a batch.

    Made once per partition and batch size (for every block of a U-Net call at once, see ``split_rows``),
    so a block's plan does no index arithmetic of its own.

    Attributes:
        both: (B·N,) each batch row's source rows, then its destination rows.
        src: (B·Ns,) and dst: (B·Nd,) the same rows apart (contiguous, ready for ``index_select``/``index_put_``).
    """

    __slots__ = ("both", "src", "dst", "sources", "destinations")

    def __init__(self, both: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, sources: int,
                 destinations: int) -> None:
        self.both, self.src, self.dst = both, src, dst
        self.sources, self.destinations = sources, destinations


def split_rows(src: torch.Tensor, dst: torch.Tensor, batch: int, tokens: int) -> list[SplitRows]:
    """The ``SplitRows`` of each of K partitions for a batch of ``batch`` rows of ``tokens`` tokens.

    Args:
        src, dst: (K, Ns) and (K, Nd) token positions, as ``partition`` gives them; or (Ns,) and (Nd,) for one.
    """
    src2, dst2 = (src, dst) if src.dim() == 2 else (src[None], dst[None])
    k, ns, nd = src2.shape[0], src2.shape[1], dst2.shape[1]
    offsets = _row_offsets(batch, tokens, src.dtype, src.device)  # (B, 1)
    src_rows = src2[:, None, :] + offsets  # (K, B, Ns)
    dst_rows = dst2[:, None, :] + offsets
    both = torch.cat([src_rows, dst_rows], dim=2).reshape(k, batch * tokens)
    src_rows, dst_rows = src_rows.reshape(k, batch * ns), dst_rows.reshape(k, batch * nd)
    return [SplitRows(b, s, d, ns, nd)
            for b, s, d in zip(both.unbind(0), src_rows.unbind(0), dst_rows.unbind(0))]


@lru_cache(maxsize=256)
def _slot_constants(batch: int, sources: int, destinations: int, r: int, dtype: torch.dtype,
                    device: torch.device):
    """Slot arithmetic that depends only on the sizes (see ``plan_merge``), as flat tensors.

    Returns:
        merged_mask (B·Ns,): 1 at the first r places of each row (sources in order of similarity), else 0;
        base (B·Ns,): the flat merged row a source at that place goes to, less its destination's slot when
            it merges (``b·M + kept`` then) and in full when it is kept (``b·M + place - r``);
        dst_slots (B·Nd,): the flat merged rows of the destinations (``b·M + kept + j``).
    """
    kept = sources - r
    merged_tokens = kept + destinations
    place = torch.arange(sources, dtype=dtype, device=device)
    rows = _row_offsets(batch, merged_tokens, dtype, device)  # (B, 1): b·M
    merged = (place < r).to(dtype)
    base = rows + torch.where(place < r, torch.full_like(place, kept), place - r)
    dst_slots = rows + kept + torch.arange(destinations, dtype=dtype, device=device)
    return merged.repeat(batch), base.reshape(-1), dst_slots.reshape(-1)


@lru_cache(maxsize=64)
def _ones(rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(rows, 1): the weight of each token in a plan's slot counts."""
    return torch.ones(rows, 1, dtype=dtype, device=device)


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
    return plan_split(metric, split_rows(src, dst, metric.shape[0], metric.shape[1])[0], r, chunk_elements)


def plan_split(metric: torch.Tensor, rows: SplitRows, r: int,
               chunk_elements: int = 1 << 22) -> MergePlan | None:
    """``plan_merge`` on a partition already laid out for this batch (``split_rows``): what a patched block
    calls, its rows made with every other block's at the U-Net call's first block."""
    batch, tokens, channels = metric.shape
    ns, nd = rows.sources, rows.destinations
    r = min(int(r), ns)
    if r <= 0 or nd == 0:
        return None
    idt = rows.both.dtype
    device = metric.device
    with torch.no_grad():
        # One gather puts each row's sources first and its destinations after them; a and b are views.
        split = metric.reshape(batch * tokens, channels).index_select(0, rows.both).view(batch, tokens, channels)
        # Cosine similarity, but only the destinations are normalised before the matmul: a source's norm
        # does not change which destination is best, so it divides the (B, Ns) best scores afterwards.
        # Norms and that division are at least float32 for half-precision tokens too, so the scores that rank
        # the sources carry one rounding (the matmul's) instead of three. The clamp only touches all-zero
        # rows, whose cosine would otherwise be NaN.
        exact = _score_dtype(metric.dtype)
        norms = torch.linalg.vector_norm(split, dim=-1, dtype=exact).clamp_min(torch.finfo(exact).tiny)
        unit_dst = (split[:, ns:].to(exact) / norms[:, ns:, None]).to(metric.dtype)
        score, best = best_destinations(split[:, :ns], unit_dst, chunk_elements)
        score = score.to(exact) / norms[:, :ns]
        order = score.argsort(dim=-1, descending=True).to(idt)  # (B, Ns): most similar sources first
        # The merged layout: kept sources in order of similarity, then the destinations. The source at place
        # p of the order goes to slot kept + best (p < r: it merges) or p - r (it is kept).
        merged_mask, base, dst_slots = _slot_constants(batch, ns, nd, r, idt, device)
        by_place = _flat(order, ns)
        slots = best.to(idt).reshape(-1).index_select(0, by_place) * merged_mask + base
        slot_index = torch.empty(batch * tokens, dtype=idt, device=device)
        slot_index.index_put_((rows.src.index_select(0, by_place),), slots)
        slot_index.index_put_((rows.dst,), dst_slots)
        merged_tokens = ns - r + nd
        counts = metric.new_zeros(batch * merged_tokens, 1).index_add_(0, slot_index,
                                                                     _ones(batch * tokens, metric.dtype, device))
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
