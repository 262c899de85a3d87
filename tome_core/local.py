"""Local merging ("Local" method): one merge plan per U-Net level and call, found inside 2×2 windows.

Exact ToMe finds a new global bipartite matching in every patched block: a (B, 3N/4, N/4) similarity product,
a sort of N/4·3 scores and scattered writes, about 84 dispatched tensor operations per block. Here:

- The token grid is tiled into 2×2 windows (row-major locals 0 1 / 2 3). A token's merge partners are the
  other tokens of its window, so finding the plan costs O(N) (one (4×C)·(C×4) Gram matrix per window) and
  no global sort.
- Each window merges a fixed number q of its tokens (0 to 3), fixed per window by the ratio alone (an even
  spread of ``int(4·W·ratio)`` merges over the W windows), so every shape is static for a given grid and
  ratio. What the features choose is *which* tokens merge: among the window's candidate groupings with q
  merges (q = 1: which one of the 6 pairs; q = 2: which one of the 3 pairings; q = 0 and q = 3 have one),
  the one whose pairs are most similar (summed cosine similarity).
- Every merged token is the mean of a group of 1, 2 or 4 tokens. Groups are padded to a common size g
  (2 when no window merges 3 tokens, else 4) by repeating their members, so merging is g gathers and
  g − 1 pairwise means, and unmerging is one gather through a position map: 8 dispatched operations per
  block (g = 2),
  whatever the image size. Padding is exact (the mean of a and a is a); for g = 4 a pair's mean is
  that of (a, b, a, b), equal to (a + b) / 2 up to rounding.
- Tokens right of or below the last whole window (odd grids) are never merged.

The plan is made once per level per U-Net call from the first patched block of that level (down path) and
used by every patched block of the level (down and up path); ``TokenMergePatch`` may also keep it for a few
sampling steps. Nothing is random: the plan is a function of the features alone, per batch row, so
splitting a batch (cond and uncond apart) gives each row the plan it would get in the whole batch.

Index tensors use the caller's index dtype (int32 on MPS) and no integer op MPS lacks: the only int64
tensor is ``argmax``'s result, converted before use.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

WINDOW = 2  # side of a window; a window holds WINDOW² = 4 tokens
MAX_MERGES = 3  # per window: all 4 tokens into one
RATIO_CAP = 1.0 - 1.0 / (WINDOW * WINDOW)

# Window locals: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right.
_PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))


def _candidates() -> list[tuple[int, tuple[tuple[int, ...], ...]]]:
    """(merges q, groups) of every grouping of a window's 4 tokens with at most one group of more than 1
    token per pair of merges: q = 0 (all alone), the 6 single pairs, the 3 pairings, q = 3 (all in one)."""
    out: list[tuple[int, tuple[tuple[int, ...], ...]]] = [(0, ((0,), (1,), (2,), (3,)))]
    for i, j in _PAIRS:
        out.append((1, ((i, j),) + tuple((k,) for k in range(4) if k not in (i, j))))
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
    """How the N tokens of a level map onto M merged tokens, for a batch of B rows.

    Attributes:
        gather_index: g tensors (B·M,) of the index dtype; merged row b·M + m is the mean over t < g of
            input rows ``gather_index[t][b·M + m]`` of the flattened (B·N, C) input.
        position: (B·N,) index dtype; input row ``b·N + n`` takes merged row ``position[b·N + n]`` of the
            flattened (B·M, C) merged tensor on unmerge.
    """

    __slots__ = ("gather_index", "position", "batch", "tokens", "merged_tokens", "group", "device")

    def __init__(self, gather_index: tuple[torch.Tensor, ...], position: torch.Tensor, batch: int, tokens: int,
                 merged_tokens: int, group: int) -> None:
        self.gather_index, self.position = gather_index, position
        self.batch, self.tokens, self.merged_tokens, self.group = batch, tokens, merged_tokens, group
        self.device = position.device

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (B, N, ·) has the batch rows and tokens this plan was made for."""
        return (x.dim() == 3 and x.shape[0] == self.batch and x.shape[1] == self.tokens
                and x.device == self.device)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, M, C): a gather of each group's t-th (padded) member, for t < g, and their mean.

        The mean as ``lerp(a, b, 0.5)``, one fused pass per pair: on the CPU, ``mean``/``sum`` over a
        dimension of size 2 took 5 to 8 times as long as the gathers themselves. ``lerp(a, a, 0.5)`` is
        exactly a, so padding changes nothing; a pair's mean is (a + b) / 2 up to rounding.
        """
        b, n, c = x.shape
        flat = x.reshape(b * n, c)
        parts = [flat.index_select(0, index) for index in self.gather_index]
        while len(parts) > 1:  # g is 2 or 4: one or two rounds of pairwise means
            parts = [torch.lerp(parts[i], parts[i + 1], 0.5) for i in range(0, len(parts), 2)]
        return parts[0].view(b, self.merged_tokens, c)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, M, C) -> (B, N, C): every token takes its group's value."""
        b, m, c = x.shape
        return x.reshape(b * m, c).index_select(0, self.position).view(b, self.tokens, c)


def _candidate_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per candidate grouping, on the CPU: its group members padded to g = 4 (11, 4, 4) (locals; groups
    beyond the candidate's count are zeros, never read), the group slot of each local (11, 4), and the
    incidence (16, 11) of the 4×4 cosine matrix's entries (row 4·i + j: locals i, j) in its score."""
    members = torch.zeros(NUM_CANDIDATES, 4, 4, dtype=torch.long)
    slot = torch.zeros(NUM_CANDIDATES, 4, dtype=torch.long)
    incidence = torch.zeros(16, NUM_CANDIDATES, dtype=torch.float32)
    for c, (_, groups) in enumerate(CANDIDATES):
        for s, g in enumerate(groups):
            members[c, s] = torch.tensor((g * 4)[:4])
            for local in g:
                slot[c, local] = s
            if len(g) == 2:
                incidence[g[0] * 4 + g[1], c] = 1.0
    return members, slot, incidence


# Few entries: one plan's tables are O(B·N) integers (about 2.5 MB for SD 1.5's top level at 1024 px, batch
# 2), kept while a generation runs at one size; a hires pass or a second batch size adds one.
@lru_cache(maxsize=8)
def _layout(batch: int, h: int, w: int, ratio: float, device: torch.device, idt: torch.dtype):
    """Everything of a plan that depends only on (B, grid, ratio): static tables, built on the CPU with
    int64 arithmetic and then moved (so no integer op runs on the device), indexed by the chosen candidate.

    Returns None when nothing merges (no whole window, or no merge at this ratio); else a dict with
        group: g; merged: M (merged tokens per row);
        window_rows: (B·W·4,) the flat input row of local l of window j in batch row b, at b·W·4 + j·4 + l;
        incidence: (16, 11) float32, see ``_candidate_tables``;
        penalty: (B·W, 11) float32, 0 for the candidates with the window's merge count, −1e4 elsewhere;
        candidate_offset: (B·W,) (b·W + j)·11: adds window (b, j) to its chosen candidate's number;
        member_rows: (B·W·11, 4·g) for window (b, j) and candidate c, the flat input rows of its 4 slots'
            g padded members;
        slot_rows: (B·W·11, 4) for window (b, j) and candidate c, each local's merged row, b·M + row;
        edge_gather: (B·E·g,) the flat input rows of the never-merged edge tokens, each repeated g times
            (None when the windows cover the grid);
        gather_picks: g tensors (B·M,): for member t, the real slots and then the edges out of
            [member rows (B·W·4·g), edge_gather];
        edge_rows: (B·E,) b·M + the merged row of edge token e (None without edges);
        position_pick: (B·N,) picks, in token order, out of [slot rows (B·W·4), edge_rows].
    """
    hw, ww = h // WINDOW, w // WINDOW
    windows = hw * ww
    if windows == 0:
        return None
    merges = window_merges(windows, ratio)
    if not any(merges):
        return None
    group = 4 if max(merges) == MAX_MERGES else 2
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
    kept = 4 - counts  # merged tokens per window
    start = torch.cumsum(kept, 0) - kept
    merged_windows = int(kept.sum())
    merged = merged_windows + e
    slots = torch.arange(4)
    real = slots[None, :] < kept[:, None]  # (W, 4)
    slot_row = torch.where(real, start[:, None] + slots[None, :], torch.zeros((), dtype=torch.long))  # (W, 4)

    members, slot, incidence = _candidate_tables()
    members = members[:, :, :group].reshape(NUM_CANDIDATES, 4 * group)  # pads of 4 cut to g: still exact
    candidate_merges = torch.tensor([q for q, _ in CANDIDATES])
    penalty = torch.where(candidate_merges[None, :] == counts[:, None], 0.0, -1e4).float().repeat(batch, 1)

    b = torch.arange(batch)
    bj = torch.arange(batch * windows)  # b·W + j
    window_rows = (b[:, None, None] * n + window_tokens[None]).reshape(batch * windows, 4)
    # (B·W, 11, 4g): rows of window (b, j) at the members of candidate c.
    member_rows = window_rows[:, None, :].expand(-1, NUM_CANDIDATES, -1).gather(
        2, members[None].expand(batch * windows, -1, -1))
    merged_row = (b[:, None, None] * merged + slot_row[None]).reshape(batch * windows, 4)
    slot_rows = merged_row[:, None, :].expand(-1, NUM_CANDIDATES, -1).gather(
        2, slot[None].expand(batch * windows, -1, -1))
    edge_gather = (b[:, None, None] * n + edges[None, :, None]).expand(batch, e, group).reshape(-1)
    # Real slots of each window, as positions j·4 + s, and each one's member t in the (B·W·4·g) rows.
    real_slots = torch.nonzero(real.reshape(-1)).reshape(-1)  # (M_w,)
    member_total = batch * windows * 4 * group
    gather_picks = tuple(torch.cat([
        b[:, None] * (windows * 4 * group) + (real_slots * group + t)[None, :],
        member_total + b[:, None] * (e * group) + (torch.arange(e) * group + t)[None, :],
    ], dim=1).reshape(-1) for t in range(group))
    edge_rows = (b[:, None] * merged + merged_windows + torch.arange(e)[None, :]).reshape(-1)
    # Token n's place in [slot rows of (b, j, l) | edge rows of (b, e)].
    place = torch.empty(n, dtype=torch.long)
    place[window_tokens.reshape(-1)] = torch.arange(windows * 4)
    place[edges] = torch.arange(e) + batch * windows * 4
    stride = torch.full((n,), windows * 4)
    stride[edges] = e
    position_pick = (place[None, :] + b[:, None] * stride[None, :]).reshape(-1)
    if e == 0:  # then the picks read the window part alone, and the plan needs no concatenation
        edge_gather = edge_rows = None

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=idt)

    return dict(group=group, merged=merged, window_rows=put(window_rows.reshape(-1)),
                incidence=incidence.to(device), penalty=penalty.to(device),
                candidate_offset=put(bj * NUM_CANDIDATES),
                member_rows=put(member_rows.reshape(batch * windows * NUM_CANDIDATES, 4 * group)),
                slot_rows=put(slot_rows.reshape(batch * windows * NUM_CANDIDATES, 4)),
                edge_gather=put(edge_gather), gather_picks=tuple(put(t) for t in gather_picks),
                edge_rows=put(edge_rows), position_pick=put(position_pick))


def plan_local(metric: torch.Tensor, h: int, w: int, ratio: float, idt: torch.dtype) -> LocalPlan | None:
    """The local merge plan of tokens ``metric`` (B, h·w, C) on an h×w grid, or None when nothing merges.

    Similarity is the cosine of the rows of ``metric`` (the first patched block's input), computed in at
    least float32. Per batch row and window, the candidate grouping with the window's merge count whose
    pairs have the highest summed cosine wins; ties go to the earlier candidate.
    """
    batch, tokens, channels = metric.shape
    if tokens != h * w:
        raise ValueError(f"plan_local: {tokens} tokens do not fill a {h}×{w} grid")
    layout = _layout(batch, h, w, float(ratio), metric.device, idt)
    if layout is None:
        return None
    # About 20 dispatched operations whatever the size, once per level and call: on a GPU each costs host
    # time the step may wait on, so everything that does not depend on the features is a table made
    # beforehand, and the chosen candidate indexes those tables directly.
    with torch.no_grad():
        # (B·W, 4, C): each window's tokens as unit vectors, in at least float32 so that half-precision
        # features rank pairs by one rounding; all-zero rows stay zero (cosine 0 with everything).
        exact = metric.dtype if metric.dtype in (torch.float32, torch.float64) else torch.float32
        win = metric.reshape(batch * tokens, channels).index_select(0, layout["window_rows"])
        unit = F.normalize(win.view(-1, 4, channels).to(exact), dim=-1, eps=torch.finfo(exact).tiny)
        cosine = torch.bmm(unit, unit.transpose(1, 2))  # (B·W, 4, 4)
        # Each candidate's summed pair cosine, and −1e4 for candidates with another merge count.
        scores = torch.addmm(layout["penalty"].to(exact), cosine.view(-1, 16), layout["incidence"].to(exact))
        key = scores.argmax(dim=-1).to(idt) + layout["candidate_offset"]  # (B·W,) rows of the tables
        picked = layout["member_rows"].index_select(0, key).view(-1)
        if layout["edge_gather"] is not None:
            picked = torch.cat([picked, layout["edge_gather"]])
        gather_index = tuple(picked.index_select(0, pick) for pick in layout["gather_picks"])
        rows = layout["slot_rows"].index_select(0, key).view(-1)
        if layout["edge_rows"] is not None:
            rows = torch.cat([rows, layout["edge_rows"]])
        position = rows.index_select(0, layout["position_pick"])
    return LocalPlan(gather_index, position, batch, tokens, layout["merged"], layout["group"])


def reference_merge(x: torch.Tensor, h: int, w: int, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's meaning, written plainly with Python loops (for tests): returns (merged (B, M, C),
    unmerged (B, N, C)) of ``x`` (B, h·w, C), with ``x`` itself as the similarity metric."""
    batch, n, _ = x.shape
    windows_y, windows_x = h // WINDOW, w // WINDOW
    merges = window_merges(windows_y * windows_x, ratio)
    merged_rows, unmerged = [], x.clone()
    for b in range(batch):
        rows, edges = [], []
        for j, q in enumerate(merges):
            wy, wx = divmod(j, windows_x)
            tokens = [(wy * 2 + dy) * w + wx * 2 + dx for dy in (0, 1) for dx in (0, 1)]
            feats = x[b, tokens].double()
            unit = feats / feats.norm(dim=-1, keepdim=True).clamp_min(1e-300)
            best, best_groups = None, None
            for cq, groups in CANDIDATES:
                if cq != q:
                    continue
                score = sum(float(unit[g[0]] @ unit[g[1]]) for g in groups if len(g) == 2)
                if best is None or score > best + 1e-6:
                    best, best_groups = score, groups
            for g in best_groups:
                mean = x[b, [tokens[i] for i in g]].mean(0)
                rows.append(mean)
                for i in g:
                    unmerged[b, tokens[i]] = mean
        for y in range(h):
            for xx in range(w):
                if y >= windows_y * 2 or xx >= windows_x * 2:
                    edges.append(x[b, y * w + xx])
        merged_rows.append(torch.stack(rows + edges))
    return torch.stack(merged_rows), unmerged
