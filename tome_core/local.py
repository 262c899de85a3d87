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
  (2 when no window merges 3 tokens, else 4) by repeating their members, so merging is one gather and one
  mean over g, and unmerging is one gather through a position map: 7 dispatched operations per block,
  whatever the image size. For g = 2 the padding is exact ((a + a) / 2 = a); for g = 4 a pair is
  averaged as (a + b + a + b) / 4, equal to (a + b) / 2 up to rounding.
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
        gather_index: (B·M·g,) index dtype; merged row m of batch row b is the mean of input rows
            ``gather_index[(b·M + m)·g : (b·M + m + 1)·g]`` of the flattened (B·N, C) input.
        position: (B·N,) index dtype; input row ``b·N + n`` takes merged row ``position[b·N + n]`` of the
            flattened (B·M, C) merged tensor on unmerge.
    """

    __slots__ = ("gather_index", "position", "batch", "tokens", "merged_tokens", "group", "device")

    def __init__(self, gather_index: torch.Tensor, position: torch.Tensor, batch: int, tokens: int,
                 merged_tokens: int, group: int) -> None:
        self.gather_index, self.position = gather_index, position
        self.batch, self.tokens, self.merged_tokens, self.group = batch, tokens, merged_tokens, group
        self.device = position.device

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (B, N, ·) has the batch rows and tokens this plan was made for."""
        return (x.dim() == 3 and x.shape[0] == self.batch and x.shape[1] == self.tokens
                and x.device == self.device)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, M, C): one gather of each group's (padded) members and their mean."""
        b, n, c = x.shape
        return x.reshape(b * n, c).index_select(0, self.gather_index).view(b, self.merged_tokens, self.group,
                                                                           c).mean(2)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, M, C) -> (B, N, C): every token takes its group's value."""
        b, m, c = x.shape
        return x.reshape(b * m, c).index_select(0, self.position).view(b, self.tokens, c)


@lru_cache(maxsize=16)
def _candidate_tables(group: int, device: torch.device, idt: torch.dtype):
    """Per candidate grouping: its padded group members (11, 4·g) (locals; groups beyond the candidate's
    count are zeros, never read), the group slot of each local (11, 4), and the incidence (16, 11) of the
    4×4 cosine matrix's entries in its score (one entry per pair)."""
    members = torch.zeros(NUM_CANDIDATES, 4, group, dtype=torch.int32)
    slot = torch.zeros(NUM_CANDIDATES, 4, dtype=torch.int32)
    incidence = torch.zeros(16, NUM_CANDIDATES, dtype=torch.float32)  # row 4·i + j: cosine of locals i, j
    for c, (_, groups) in enumerate(CANDIDATES):
        for s, g in enumerate(groups):
            if len(g) <= group:  # a group of 4 exists only in tables with g = 4
                members[c, s] = torch.tensor((g * group)[:group], dtype=torch.int32)
            for local in g:
                slot[c, local] = s
            if len(g) == 2:
                incidence[g[0] * 4 + g[1], c] = 1.0
    return (members.reshape(NUM_CANDIDATES, 4 * group).to(device, idt), slot.to(device, idt),
            incidence.to(device))


@lru_cache(maxsize=64)
def _layout(batch: int, h: int, w: int, ratio: float, device: torch.device, idt: torch.dtype):
    """Everything of a plan that depends only on (B, grid, ratio): static index tables.

    Returns None when nothing merges (no whole window, or no merge at this ratio); else a dict with
        group: g; merged: M (merged tokens per row);
        window_rows: (B·W·4,) the flat input row of local l of window j in batch row b, at b·W·4 + j·4 + l;
        penalty: (B·W, 11) float32, 0 for the candidates with the window's merge count, −1e4 elsewhere;
        member_offset: (B·W, 4·g) b·W·4 + j·4, turning a window's locals into positions in window_rows;
        slot_offset: (B·W, 4) the same for (b, j, local);
        slot_rows: (B·W·4,) b·M + the merged row of slot s of window j (0 for slots the window lacks);
        edge_gather: (B·E·g,) the flat input rows of the never-merged edge tokens, each repeated g times;
        gather_pick: (B·M·g,) picks the real slots, then the edges, out of [members (B·W·4·g), edge_gather];
        edge_rows: (B·E,) b·M + the merged row of edge token e;
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
    local_offset = torch.tensor([0, 1, w, w + 1])
    window_tokens = origin[:, None] + local_offset[None, :]  # (W, 4)
    edges = (yy * w + xx)[~inside]  # (E,)
    e = edges.numel()

    counts = torch.tensor(merges)
    kept = 4 - counts  # merged tokens per window
    start = torch.cumsum(kept, 0) - kept
    merged_windows = int(kept.sum())
    merged = merged_windows + e
    slots = torch.arange(4)
    real = slots[None, :] < kept[:, None]  # (W, 4)
    slot_row = torch.where(real, start[:, None] + slots[None, :], torch.zeros(()).long())  # (W, 4)

    candidate_merges = torch.tensor([q for q, _ in CANDIDATES])
    penalty = torch.where(candidate_merges[None, :] == counts[:, None], 0.0, -1e4).float()  # (W, 11)
    penalty = penalty.repeat(batch, 1)

    b = torch.arange(batch)
    window_rows = (b[:, None, None] * n + window_tokens[None]).reshape(-1)
    base = (b[:, None] * (windows * 4) + torch.arange(windows)[None, :] * 4)  # (B, W)
    member_offset = base[:, :, None].expand(batch, windows, 4 * group).reshape(batch * windows, 4 * group)
    slot_offset = base[:, :, None].expand(batch, windows, 4).reshape(batch * windows, 4)
    slot_rows = (b[:, None] * merged + slot_row.reshape(-1)[None, :]).reshape(-1)
    edge_gather = (b[:, None, None] * n + edges[None, :, None]).expand(batch, e, group).reshape(-1)
    # Real slots of each window, their g members each: positions in the (B·W·4·g) members tensor.
    real_slots = torch.nonzero(real.reshape(-1)).reshape(-1)  # (M_w,) as j·4 + s
    per_row = (real_slots[:, None] * group + torch.arange(group)[None, :]).reshape(-1)  # (M_w·g,)
    member_total = batch * windows * 4 * group
    gather_pick = torch.cat([
        b[:, None] * (windows * 4 * group) + per_row[None, :],
        member_total + b[:, None] * (e * group) + torch.arange(e * group)[None, :],
    ], dim=1).reshape(-1)
    edge_rows = (b[:, None] * merged + merged_windows + torch.arange(e)[None, :]).reshape(-1)
    # Token n's place in [slot rows of (b, j, l) | edge rows of (b, e)].
    place = torch.empty(n, dtype=torch.long)
    place[window_tokens.reshape(-1)] = torch.arange(windows * 4)
    place[edges] = torch.arange(e) + batch * windows * 4  # plus b·E below
    is_edge = torch.zeros(n, dtype=torch.long)
    is_edge[edges] = 1
    position_pick = (place[None, :] + b[:, None] * torch.where(is_edge.bool(), e, windows * 4)[None, :])
    position_pick = position_pick.reshape(-1)

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=idt)

    if e == 0:  # then the picks read the window part alone, and the plan needs no concatenation
        edge_gather = edge_rows = None
    return dict(group=group, merged=merged, window_rows=put(window_rows), penalty=penalty.to(device),
                member_offset=put(member_offset), slot_offset=put(slot_offset), slot_rows=put(slot_rows),
                edge_gather=put(edge_gather), gather_pick=put(gather_pick), edge_rows=put(edge_rows),
                position_pick=put(position_pick))


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
    group = layout["group"]
    members, slot, incidence = _candidate_tables(group, metric.device, idt)
    # About 25 dispatched operations whatever the size, once per level and call: on a GPU each costs host
    # time the step may wait on, so every table that does not depend on the features is made beforehand.
    with torch.no_grad():
        # (B·W, 4, C): each window's tokens as unit vectors, in at least float32 so that half-precision
        # features rank pairs by one rounding; all-zero rows stay zero (cosine 0 with everything).
        win = metric.reshape(batch * tokens, channels).index_select(0, layout["window_rows"])
        exact = torch.promote_types(metric.dtype, torch.float32)
        unit = F.normalize(win.view(-1, 4, channels).to(exact), dim=-1, eps=torch.finfo(exact).tiny)
        cosine = torch.bmm(unit, unit.transpose(1, 2))  # (B·W, 4, 4)
        # Each candidate's summed pair cosine, and −1e4 for candidates with another merge count.
        scores = torch.addmm(layout["penalty"].to(exact), cosine.view(-1, 16), incidence.to(exact))
        choice = scores.argmax(dim=-1).to(idt)  # (B·W,)
        # Gather index: each window's padded groups, located in the input, then only the real slots.
        local = members.index_select(0, choice) + layout["member_offset"]
        picked = layout["window_rows"].index_select(0, local.view(-1))
        if layout["edge_gather"] is not None:
            picked = torch.cat([picked, layout["edge_gather"]])
        gather_index = picked.index_select(0, layout["gather_pick"])
        # Position map: each token's slot in its window, then that slot's merged row, in token order.
        token_slot = slot.index_select(0, choice) + layout["slot_offset"]
        rows = layout["slot_rows"].index_select(0, token_slot.view(-1))
        if layout["edge_rows"] is not None:
            rows = torch.cat([rows, layout["edge_rows"]])
        position = rows.index_select(0, layout["position_pick"])
    return LocalPlan(gather_index, position, batch, tokens, layout["merged"], group)


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
