"""Stack merging ("Stack" method): a level's tokens reduced once at a transformer stack's entrance, every block of
the stack (self-attention, cross-attention, MLP) run on the reduced tokens, and the tokens restored once at its
exit.

Why: on SDXL at 1024 px self-attention's scores are 12% of a U-Net step's multiply-adds and the MLPs 44%; the
second level (1,024 tokens, ten blocks a stack) holds 63% of the work. A method that thins out only
self-attention, block by block, is capped near 1.06x there; running whole stacks on fewer tokens reaches the
projections, cross-attention and MLPs too, and one plan per level serves every stack of it.

- Groups are found as the local method finds them (``tome_core.local``): the grid is tiled into 2×2 windows,
  each merging a number of its tokens fixed by the ratio alone, the features choosing which (of the three
  pairings with two merges per window). Shapes are static for a grid and ratio, and nothing is random: the
  plan is a function of the features per batch row, so cond and uncond give each row the same plan together
  or apart.
- A group enters the stack as the mean of its tokens (one ``index_add_`` and a division).
- At the exit every token keeps its own input and receives what the stack added to its group: ``x + (Y − X̃)``
  copied back to the group's tokens, where X̃ is the merged input and Y the last block's output (computed as
  ``(x − X̃) + Y`` per token, the offsets taken at the entrance). Copying Y itself would replace each token's
  input, detail the stack did not compute, by its group's mean.
- The plan is made once per level and U-Net call from the first stack of the level that runs (down path) and
  used by every stack of the level (down and up path); the patch may keep it for a few sampling steps
  (``local_replan``), as it does the local method's.

The tables that do not depend on the features are made once per (batch, grid, ratio) on the CPU with int64
arithmetic and moved to the device, so no integer op runs there; index tensors use the caller's index dtype
(int32 on Apple's MPS).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .local import CANDIDATES, NUM_CANDIDATES, WindowTables, chosen_candidates, window_tables


class StackPlan:
    """How the N tokens of a level map onto M merged groups, for a batch of B rows.

    Attributes:
        index: (B, N) of the index dtype: token n of row b belongs to merged row ``index[b, n]`` of row b.
        counts: (B, M, 1) float32: the tokens of each merged row.

    Merging is a ``scatter_add_`` and a division, each token's offset from its group's mean a ``gather`` and a
    subtraction, restoring a ``gather`` and an addition, all along the token dimension with one index expanded
    over the channels (a view, made once per plan and channel count): seven dispatched operations per stack,
    whatever the image size.
    """

    __slots__ = ("index", "counts", "batch", "tokens", "merged_tokens", "device", "_expanded", "_counts")

    def __init__(self, index: torch.Tensor, counts: torch.Tensor, merged_tokens: int) -> None:
        self.index, self.counts = index, counts
        self.batch, self.tokens = index.shape
        self.merged_tokens = merged_tokens
        self.device = index.device
        self._expanded: dict[int, torch.Tensor] = {}
        self._counts: dict[torch.dtype, torch.Tensor] = {torch.float32: counts}

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (B, N, ·) has the batch rows and tokens this plan was made for."""
        return (x.dim() == 3 and x.shape[0] == self.batch and x.shape[1] == self.tokens
                and x.device == self.device)

    def _index(self, channels: int) -> torch.Tensor:
        found = self._expanded.get(channels)
        if found is None:
            found = self._expanded[channels] = self.index[:, :, None].expand(-1, -1, channels)
        return found

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, M, C): each group's mean."""
        b, _, c = x.shape
        counts = self._counts.get(x.dtype)
        if counts is None:
            counts = self._counts[x.dtype] = self.counts.to(x.dtype)
        return x.new_zeros(b, self.merged_tokens, c).scatter_add_(1, self._index(c), x) / counts

    def offsets(self, x: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        """(B, N, C): each token of ``x`` (the stack's input) less its group's mean ``merged`` = ``merge(x)``
        (B, M, C). Taken before the stack runs: Forge's blocks add their residuals into their input in place."""
        return x - torch.gather(merged, 1, self._index(x.shape[2]))

    def restore(self, offsets: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The stack's output on all N tokens from ``offsets`` (see ``offsets``) and ``y`` (B, M, C), the last
        block's output on the merged tokens: each token gets its own input plus what the stack added to its
        group, x + (y − merged) gathered to the group's tokens (B, N, C)."""
        return offsets + torch.gather(y, 1, self._index(offsets.shape[2]))


@dataclass(frozen=True)
class StackTables:
    """What a stack plan needs beyond the local method's ``WindowTables`` (``local``).

    group_rows: (B·W·11, 4) for window (b, j) and candidate c, the merged row (of batch row b) of the group of
        each local l.
    edge_rows: (B·E,) the merged rows of the never-merged edge tokens, or None when the windows cover the grid.
    token_order: (B·N,) for each input row, its place in [window locals (B·W·4, (b·W + j)·4 + l), edges].
    ones: (B, N, 1) float32 ones, each token's weight in its group's count.
    fixed: (index, counts) when no window has a choice, else None.
    """

    local: WindowTables
    group_rows: torch.Tensor
    edge_rows: torch.Tensor | None
    token_order: torch.Tensor
    ones: torch.Tensor
    fixed: tuple[torch.Tensor, torch.Tensor] | None


def _slot_of_local() -> torch.Tensor:
    """(11, 4): for candidate c and local l, the slot (group number) holding l."""
    table = torch.zeros(NUM_CANDIDATES, 4, dtype=torch.long)
    for c, (_, groups) in enumerate(CANDIDATES):
        for s, group in enumerate(groups):
            for local in group:
                table[c, local] = s
    return table


# As few entries as the local method's table cache, for the same reason (one per batch size and grid of a generation).
@lru_cache(maxsize=8)
def stack_tables(batch: int, h: int, w: int, ratio: float, device: torch.device,
                  idt: torch.dtype) -> StackTables | None:
    cpu = window_tables(batch, h, w, ratio, torch.device("cpu"), torch.int64)
    if cpu is None:
        return None
    n = h * w
    merged = cpu.merged
    windows = (h // 2) * (w // 2)
    bw = batch * windows
    keep_pick = cpu.keep_pick
    slots = bw * 4 + (0 if cpu.edge_rows is None else cpu.edge_rows.numel())
    # Merged row of each entry of [the chosen candidates' slots (B·W·4), edges]; slots no group holds: 0 (a
    # candidate with another merge count is never chosen, so those are never read).
    row_of_slot = torch.zeros(slots, dtype=torch.long)
    row_of_slot[keep_pick] = torch.arange(batch * merged) % merged
    slot = _slot_of_local()  # (11, 4)
    window_slot = (torch.arange(bw)[:, None, None] * 4 + slot[None]).reshape(bw * NUM_CANDIDATES, 4)
    group_rows = row_of_slot[window_slot]  # (B·W·11, 4)
    edge_rows = None if cpu.edge_rows is None else row_of_slot[bw * 4:]
    # Input row b·N + t: a window local at (b·W + j)·4 + l, else edge e of row b at B·W·4 + b·E + e.
    token_order = torch.empty(batch * n, dtype=torch.long)
    token_order[cpu.window_rows] = torch.arange(bw * 4)
    if cpu.edge_rows is not None:
        token_order[cpu.edge_rows] = torch.arange(bw * 4, slots)

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=idt)

    fixed = None
    if cpu.fixed_keep is not None:
        key = cpu.penalty.argmax(-1) + torch.arange(bw) * NUM_CANDIDATES
        rows = group_rows[key].reshape(-1)
        if edge_rows is not None:
            rows = torch.cat([rows, edge_rows])
        index = rows[token_order].view(batch, n)
        counts = torch.zeros(batch, merged, 1).scatter_add_(1, index[:, :, None], torch.ones(batch, n, 1))
        fixed = (put(index), counts.to(device))
    return StackTables(window_tables(batch, h, w, ratio, device, idt), put(group_rows), put(edge_rows),
                        put(token_order), torch.ones(batch, n, 1, device=device), fixed)


def plan_stack(metric: torch.Tensor, h: int, w: int, ratio: float, idt: torch.dtype) -> StackPlan | None:
    """The stack plan of tokens ``metric`` (B, h·w, C) on an h×w grid (a stack's input), or None when nothing
    merges: the local method's groups (``tome_core.local.plan_local``), each merged row the mean of its
    group."""
    batch, tokens, _ = metric.shape
    if tokens != h * w:
        raise ValueError(f"plan_stack: {tokens} tokens do not fill a {h}×{w} grid")
    tables = stack_tables(batch, h, w, float(ratio), metric.device, idt)
    if tables is None:
        return None
    merged = tables.local.merged
    if tables.fixed is not None:
        return StackPlan(*tables.fixed, merged)
    with torch.no_grad():
        key = chosen_candidates(metric, tables.local, idt)
        rows = tables.group_rows.index_select(0, key).view(-1)
        if tables.edge_rows is not None:
            rows = torch.cat([rows, tables.edge_rows])
        index = rows.index_select(0, tables.token_order).view(batch, tokens)
        counts = tables.ones.new_zeros(batch, merged, 1).scatter_add_(1, index[:, :, None], tables.ones)
    return StackPlan(index, counts, merged)
