"""Local merging ("Local" method): self-attention's keys and values from one plan per U-Net level and call,
found inside 2×2 windows; queries stay whole.

Exact ToMe finds a new global bipartite matching in every patched block (a (B, 3N/4, N/4) similarity product,
a sort and scattered writes, about 100 dispatched tensor operations per block) and merges queries too, whose
copies back after attention are what changes the picture most. Here:

- The token grid is tiled into 2×2 windows (row-major locals 0 1 / 2 3). A token's merge partners are the
  other tokens of its window, so finding the plan costs O(N) (one (4×C)·(C×4) Gram matrix per window) and
  no global sort.
- Each window merges a fixed number q of its tokens (0 to 3), fixed per window by the ratio alone (an even
  spread of ``int(4·W·ratio)`` merges over the W windows), so every shape is static for a given grid and
  ratio. With q = 2 the features choose *which* tokens merge: of the 3 pairings of the window's tokens, the
  one whose pairs are most similar (summed cosine similarity). With q = 1 the pair is fixed, the bottom-right
  token with the bottom-left one: choosing the most similar of the 6 pairs left an irregular set of tokens
  and measured far worse on the proxies (40.4 against 53.5 dB on one, 60.6 against 66.9 on the other).
  q = 0 and q = 3 have one grouping each.
- A group stands for itself in keys and values by its first member (lowest local), a real token: the mean
  of the group, measured on the proxy, moved the picture far more (40.1 dB against 57.9 dB with 3 merges
  per window, where the two differ only in this). Queries are never merged, so nothing is unmerged and
  every token keeps its own attention output.
- The kept tokens are one gather per key/value source: 1 dispatched operation and a view per patched block,
  whatever the image size. Tokens right of or below the last whole window (odd grids) are always kept.

The plan is made once per level per U-Net call from the first patched block of that level (down path) and
used by every patched block of the level (down and up path); ``TokenMergePatch`` may also keep it for a few
sampling steps. Nothing is random: the plan is a function of the features alone, per batch row, so
splitting a batch (cond and uncond apart) gives each row the plan it would get in the whole batch. With
3 merges in every window the plan is ToDo's nearest downsampling by 2 (the top-left token of each window).

Index tensors use the caller's index dtype (int32 on MPS) and no integer op MPS lacks: the only int64
tensor is ``argmax``'s result, converted before use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

WINDOW = 2  # side of a window; a window holds WINDOW² = 4 tokens
MAX_MERGES = 3  # per window: all 4 tokens into one

# Window locals: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right.
_PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
SINGLE_MERGE_PAIR = (2, 3)  # the pair a window with one merge merges, whatever the features


def _candidates() -> list[tuple[int, tuple[tuple[int, ...], ...]]]:
    """(merges q, groups) of every grouping of a window's 4 tokens with at most one group of more than 1
    token per pair of merges: q = 0 (all alone), the 6 single pairs, the 3 pairings, q = 3 (all in one).
    Groups are listed by their first member, each group's members in ascending order."""
    out: list[tuple[int, tuple[tuple[int, ...], ...]]] = [(0, ((0,), (1,), (2,), (3,)))]
    for i, j in _PAIRS:
        groups = ((i, j),) + tuple((k,) for k in range(4) if k not in (i, j))
        out.append((1, tuple(sorted(groups))))
    for i, j in _PAIRS[:3]:  # the pairing holding (0, j) and its complement
        rest = tuple(k for k in range(4) if k not in (i, j))
        out.append((2, ((i, j), rest)))
    out.append((3, ((0, 1, 2, 3),)))
    return out


CANDIDATES = _candidates()
NUM_CANDIDATES = len(CANDIDATES)  # 11


def window_merges(windows: int, ratio: float) -> list[int]:
    """Merges of each of ``windows`` windows: ``int(4·windows·ratio)`` in all (at most 3 per window), spread
    evenly in row-major window order (window j gets floor((j+1)·R/W) − floor(j·R/W))."""
    total = min(int(WINDOW * WINDOW * windows * ratio), MAX_MERGES * windows)
    return [((j + 1) * total) // windows - (j * total) // windows for j in range(windows)]


class LocalPlan:
    """Which of the N tokens of a level stand for the M merged groups, for a batch of B rows.

    Attributes:
        keep_index: (B·M,) of the index dtype; merged row b·M + m is input row ``keep_index[b·M + m]`` of
            the flattened (B·N, C) input (rows of batch row b stay in b's block).
    """

    __slots__ = ("keep_index", "batch", "tokens", "merged_tokens", "device", "sizes", "_log_sizes")

    def __init__(self, keep_index: torch.Tensor, batch: int, tokens: int, merged_tokens: int,
                 sizes: torch.Tensor | None = None) -> None:
        self.keep_index = keep_index
        self.batch, self.tokens, self.merged_tokens = batch, tokens, merged_tokens
        self.device = keep_index.device
        self.sizes = sizes  # (B·M,) float32: the tokens each kept row stands for
        self._log_sizes: torch.Tensor | None = None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (B, N, ·) has the batch rows and tokens this plan was made for."""
        return (x.dim() == 3 and x.shape[0] == self.batch and x.shape[1] == self.tokens
                and x.device == self.device)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, M, C): each group's first member, by one gather."""
        b, n, c = x.shape
        return x.reshape(b * n, c).index_select(0, self.keep_index).view(b, self.merged_tokens, c)

    def key_log_sizes(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, M) log of the tokens each kept row stands for (its group's size), for size-weighted keys; made
        once per plan, which every patched block of the level shares."""
        if self._log_sizes is None or self._log_sizes.dtype != dtype:
            self._log_sizes = self.sizes.to(dtype).log().view(self.batch, self.merged_tokens)
        return self._log_sizes


def _candidate_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per candidate grouping, on the CPU: the first member of each of its groups, in slots 0..3 (11, 4)
    (slots beyond the candidate's group count are zeros, never read); the incidence (16, 11) of the
    4×4 cosine matrix's entries (row 4·i + j: locals i, j) in its score; and each slot's group size (11, 4)
    (1 beyond the group count)."""
    first = torch.zeros(NUM_CANDIDATES, 4, dtype=torch.long)
    incidence = torch.zeros(16, NUM_CANDIDATES, dtype=torch.float32)
    sizes = torch.ones(NUM_CANDIDATES, 4, dtype=torch.float32)
    for c, (_, groups) in enumerate(CANDIDATES):
        for s, g in enumerate(groups):
            first[c, s] = g[0]
            sizes[c, s] = len(g)
            if len(g) == 2:
                incidence[g[0] * 4 + g[1], c] = 1.0
    return first, incidence, sizes


@dataclass(frozen=True)
class WindowTables:
    """Everything of a local (or stack) plan that depends only on (B, grid, ratio): static tables, built on
    the CPU with int64 arithmetic and then moved (so no integer op runs on the device), indexed by the chosen
    candidate. Index tensors are of the caller's index dtype.

    Attributes:
        merged: M (kept tokens per row).
        window_rows: (B·W·4,) the flat input row of local l of window j in batch row b, at b·W·4 + j·4 + l.
        incidence: (16, 11) float32, see ``_candidate_tables``.
        penalty: (B·W, 11) float32, 0 for the candidates the window may take (its merge count; with one
            merge, the fixed pair only), −1e4 elsewhere.
        candidate_offset: (B·W,) (b·W + j)·11: adds window (b, j) to its chosen candidate's number.
        first_rows: (B·W·11, 4) for window (b, j) and candidate c, the flat input rows of its groups' first
            members.
        first_sizes: (B·W·11, 4) float32, the same groups' sizes.
        edge_rows: (B·E,) the flat input rows of the never-merged edge tokens (None when the windows cover
            the grid); edge_sizes: (B·E,) their sizes (ones), or None.
        keep_pick: (B·M,) picks, for batch row b: its windows' real slots, then its edges, out of
            [first rows of the chosen candidates (B·W·4), edge_rows].
        fixed_keep: (B·M,) the plan's ``keep_index`` when no window has a choice, else None; fixed_sizes its
            groups' sizes.
    """

    merged: int
    window_rows: torch.Tensor
    incidence: torch.Tensor
    penalty: torch.Tensor
    candidate_offset: torch.Tensor
    first_rows: torch.Tensor
    first_sizes: torch.Tensor
    edge_rows: torch.Tensor | None
    edge_sizes: torch.Tensor | None
    keep_pick: torch.Tensor
    fixed_keep: torch.Tensor | None
    fixed_sizes: torch.Tensor | None


# Few entries: one plan's tables are O(B·N) integers (about 1 MB for SD 1.5's top level at 1024 px, batch 2),
# kept while a generation runs at one size; a hires pass or a second batch size adds one.
@lru_cache(maxsize=8)
def window_tables(batch: int, h: int, w: int, ratio: float, device: torch.device,
                  idt: torch.dtype) -> WindowTables | None:
    """The ``WindowTables`` of a batch of ``batch`` rows on an h×w grid at ``ratio``, or None when nothing
    merges (no whole window, or no merge at this ratio)."""
    hw, ww = h // WINDOW, w // WINDOW
    windows = hw * ww
    if windows == 0:
        return None
    merges = window_merges(windows, ratio)
    if not any(merges):
        return None
    n = h * w
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    inside = (yy < hw * WINDOW) & (xx < ww * WINDOW)
    # Window j = (wy, wx) row-major; local l = 2·dy + dx.
    wy, wx = torch.arange(hw)[:, None], torch.arange(ww)[None, :]
    origin = (wy * WINDOW * w + wx * WINDOW).reshape(-1)  # (W,)
    window_tokens = origin[:, None] + torch.tensor([0, 1, w, w + 1])[None, :]  # (W, 4)
    edges = (yy * w + xx)[~inside]  # (E,)
    e = edges.numel()

    counts = torch.tensor(merges)
    kept = 4 - counts  # groups per window
    merged = int(kept.sum()) + e
    real = torch.arange(4)[None, :] < kept[:, None]  # (W, 4)

    first, incidence, group_sizes = _candidate_tables()
    candidate_merges = torch.tensor([q for q, _ in CANDIDATES])
    allowed = torch.tensor([q != 1 or SINGLE_MERGE_PAIR in groups for q, groups in CANDIDATES])
    penalty = torch.where((candidate_merges[None, :] == counts[:, None]) & allowed[None, :], 0.0, -1e4)
    penalty = penalty.float().repeat(batch, 1)

    b = torch.arange(batch)
    bj = torch.arange(batch * windows)  # b·W + j
    window_rows = (b[:, None, None] * n + window_tokens[None]).reshape(batch * windows, 4)
    # (B·W, 11, 4): rows of window (b, j) at the first members of candidate c's groups.
    first_rows = window_rows[:, None, :].expand(-1, NUM_CANDIDATES, -1).gather(
        2, first[None].expand(batch * windows, -1, -1))
    # (B·W·11, 4) the same candidates' group sizes, and the edges' (one token each).
    first_sizes = group_sizes[None].expand(batch * windows, -1, -1).reshape(batch * windows * NUM_CANDIDATES, 4)
    edge_sizes = torch.ones(batch * e)
    edge_rows = (b[:, None] * n + edges[None, :]).reshape(-1)
    real_slots = torch.nonzero(real.reshape(-1)).reshape(-1)  # positions j·4 + s of the real slots
    keep_pick = torch.cat([b[:, None] * (windows * 4) + real_slots[None, :],
                           batch * windows * 4 + b[:, None] * e + torch.arange(e)[None, :]], dim=1).reshape(-1)

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=idt)

    # When no window has a choice (only one and three merges: ratios up to 0.25, and 0.75), the plan does not
    # depend on the features: it is made here once, and a U-Net call spends no operation on it.
    fixed_keep = fixed_sizes = None
    if bool(((penalty == 0).sum(-1) == 1).all()):
        key = penalty.argmax(-1) + bj * NUM_CANDIDATES
        picked = torch.cat([first_rows.reshape(-1, 4)[key].reshape(-1), edge_rows])
        fixed_keep = put(picked[keep_pick])
        fixed_sizes = torch.cat([first_sizes[key].reshape(-1), edge_sizes])[keep_pick].to(device)

    return WindowTables(merged=merged, window_rows=put(window_rows.reshape(-1)), incidence=incidence.to(device),
                        penalty=penalty.to(device), candidate_offset=put(bj * NUM_CANDIDATES),
                        first_rows=put(first_rows.reshape(batch * windows * NUM_CANDIDATES, 4)),
                        first_sizes=first_sizes.to(device), edge_rows=put(edge_rows) if e else None,
                        edge_sizes=edge_sizes.to(device) if e else None, keep_pick=put(keep_pick),
                        fixed_keep=fixed_keep, fixed_sizes=fixed_sizes)


def plan_local(metric: torch.Tensor, h: int, w: int, ratio: float, idt: torch.dtype,
               with_sizes: bool = False) -> LocalPlan | None:
    """The local plan of tokens ``metric`` (B, h·w, C) on an h×w grid, or None when nothing merges; with
    ``with_sizes``, the plan also knows each kept row's group size (for size-weighted keys).

    Similarity is the cosine of the rows of ``metric`` (the first patched block's input), computed in at
    least float32. Per batch row and window, the candidate grouping with the window's merge count whose
    pairs have the highest summed cosine wins (with one merge: the fixed pair); ties go to the earlier
    candidate.
    """
    batch, tokens, channels = metric.shape
    if tokens != h * w:
        raise ValueError(f"plan_local: {tokens} tokens do not fill a {h}×{w} grid")
    tables = window_tables(batch, h, w, float(ratio), metric.device, idt)
    if tables is None:
        return None
    if tables.fixed_keep is not None:
        return LocalPlan(tables.fixed_keep, batch, tokens, tables.merged, tables.fixed_sizes)
    # About a dozen dispatched operations whatever the size, once per level and call: on a GPU each costs
    # host time the step may wait on, so everything that does not depend on the features is a table made
    # beforehand, and the chosen candidate indexes those tables directly.
    with torch.no_grad():
        key = chosen_candidates(metric, tables, idt)
        picked = tables.first_rows.index_select(0, key).view(-1)
        if tables.edge_rows is not None:
            picked = torch.cat([picked, tables.edge_rows])
        keep_index = picked.index_select(0, tables.keep_pick)
        sizes = None
        if with_sizes:
            sizes = tables.first_sizes.index_select(0, key).view(-1)
            if tables.edge_sizes is not None:
                sizes = torch.cat([sizes, tables.edge_sizes])
            sizes = sizes.index_select(0, tables.keep_pick)
    return LocalPlan(keep_index, batch, tokens, tables.merged, sizes)


def chosen_candidates(metric: torch.Tensor, tables: WindowTables, idt: torch.dtype) -> torch.Tensor:
    """(B·W,) of ``idt``: for each window (b, j) the row (b·W + j)·11 + c of the per-candidate tables of the
    grouping c it takes, from tokens ``metric`` (B, N, C) and the grid's ``WindowTables``.

    Per window, the candidate with the window's merge count whose pairs have the highest summed cosine wins
    (with one merge: the fixed pair); ties go to the earlier candidate."""
    batch, tokens, channels = metric.shape
    # (B·W, 4, C): each window's tokens as unit vectors, in at least float32 so that half-precision features
    # rank pairs by one rounding; all-zero rows stay zero (cosine 0 with everything).
    exact = metric.dtype if metric.dtype in (torch.float32, torch.float64) else torch.float32
    win = metric.reshape(batch * tokens, channels).index_select(0, tables.window_rows)
    unit = F.normalize(win.view(-1, 4, channels).to(exact), dim=-1, eps=torch.finfo(exact).tiny)
    cosine = torch.bmm(unit, unit.transpose(1, 2))  # (B·W, 4, 4)
    # Each candidate's summed pair cosine, and −1e4 for candidates with another merge count.
    scores = torch.addmm(tables.penalty.to(exact), cosine.view(-1, 16), tables.incidence.to(exact))
    return scores.argmax(dim=-1).to(idt) + tables.candidate_offset
