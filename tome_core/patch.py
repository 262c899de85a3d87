"""Reversible patching of U-Nets (ldm/sgm and diffusers): forward hooks only, no class swap, nothing global.

What differs between the families (which module is a transformer, how its calls name their arguments) is in
``tome_core.families``; the hooks and plans here are the same for all. Per patched transformer block:
- the enclosing transformer's pre-hook records the block's token grid (h, w) from its input, so the
  grid is known exactly for every latent size and call style;
- the block's pre-hook computes one merge plan from the block input (or nothing outside the step window,
  at ratio 0, or on a level that is not selected), and its post-hook drops it;
- pre/post hooks on ``attn1`` / ``attn2`` / ``ff`` merge their input and unmerge their output (ToMe), or give
  ``attn1`` a reduced key/value source: a downsampled grid (ToDo) or the level's local plan's kept tokens
  (Local).
The stack method hooks each selected transformer's first and last block instead: the first block's pre-hook
merges the tokens by the level's plan, every block runs on them, and the last block's post-hook restores them
(``tome_core.stack``).
The U-Net's own pre-hook records the call's timestep for the random partition. A block with no plan runs
exactly its original code.

Our markers (``_tokenmerge_patch``) differ from tomesd's (``ToMeBlock``, ``_tome_info``, ``_parent``), so the
webui's built-in ``tomesd.remove_patch`` and ours never undo each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .families import (BiasedAttention, Family, family_of, first_arg, nothing_to_patch, resolve_unet, set_slot,
                       slot_value)
from .local import LocalPlan, plan_local
from .stack import StackPlan, plan_stack
from .merge import MergePlan, SplitLayout, downsample_tokens, plan_split, split_layouts
from .options import WINDOW_METHODS, MergeOptions, check_number
from .partition import cell_choices, fixed_partition, host_key, partition, timestep_words

PATCH_ATTR = "_tokenmerge_patch"
DEFAULT_SEED = 0
_TODO = object()  # plan marker: this block call downsamples keys/values on the grid


class _BlockRecord:
    __slots__ = ("name", "index", "level", "module", "self_attention", "grid", "plan", "key", "row", "layout",
                 "used", "key_bias")

    def __init__(self, name: str, index: int, level: int, module: nn.Module, family: Family) -> None:
        self.name, self.index, self.level, self.module = name, index, level, module
        self.self_attention = family.attends_to_image(module)
        self.grid: tuple[int, int] | None = None
        self.plan: MergePlan | object | None = None
        # (batch, tokens) of the block input the plan was made for: an attention call on anything else (a
        # subset of the batch, tiled tokens) runs as it would unpatched.
        self.layout: tuple[int, int] = (0, 0)
        self.used = False  # the plan reached at least one attention or MLP call of this block call
        # Size-weighted keys, where the family's attention takes no bias: (B, M) for attn1's call under way.
        self.key_bias: torch.Tensor | None = None
        self.key = 0
        self.row = 0  # its place among the selected blocks: its row of a call's random partitions

    def take_key_bias(self) -> torch.Tensor | None:
        """The size-weighted keys' bias pending for attn1's call under way, once."""
        bias, self.key_bias = self.key_bias, None
        return bias


@dataclasses.dataclass(frozen=True)
class PatchedBlock:
    """A transformer block a patch acts on, as the glue, the benchmark and the tests see it.

    Attributes:
        name: its module path under the U-Net (``input_blocks.1.1.transformer_blocks.0``).
        level: the U-Net's downsampling level it sits at (0 = latent resolution).
        block: the block module.
        self_attention: its ``attn1`` where that attends to the image tokens (the layer merged or reduced),
            else None.
    """

    name: str
    level: int
    block: nn.Module
    self_attention: nn.Module | None


def _is_block(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("attn1", "attn2", "ff", "norm1", "norm2", "norm3"))


def transformer_levels(root: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """Every transformer (ldm ``SpatialTransformer``, diffusers ``Transformer2DModel``) under ``root`` with its
    downsampling level (0 = latent resolution), in call order; see ``Family.transformer_levels``. A wrapper
    (``model.model.diffusion_model``, ``model.diffusion_model``) stands for what it wraps (``resolve_unet``)."""
    root = resolve_unet(root)
    family = family_of(root)
    return family.transformer_levels(root) if family is not None else []


def check_loaded(root: nn.Module) -> None:
    """Refuse a U-Net whose weights are not in memory: on the meta device (built empty, or offloaded by
    accelerate's sequential CPU offload), or behind accelerate hooks that move its sub-modules' weights in
    at each call. Such a model's every block call would move weights the plan does not need, and one built
    empty computes nothing. Moving the whole model at its call (``enable_model_cpu_offload``) is fine."""
    for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
        if tensor.is_meta:
            raise ValueError(f"{type(root).__name__} has weights on the meta device ({name or 'a parameter'}): it "
                             f"was built empty or is offloaded by accelerate (sequential CPU offload); load its "
                             f"weights, or use model CPU offload, before patching")
    for name, module in root.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is not None and (getattr(hook, "offload", False) or getattr(hook, "weights_map", None) is not None
                                 or any(getattr(h, "offload", False) for h in getattr(hook, "hooks", ()))):
            raise ValueError(f"{type(root).__name__} is offloaded by accelerate hooks ({name or 'the model'} loads "
                             f"its weights at each call); use model CPU offload, or none, before patching")


class TokenMergePatch:
    """The live state of one patched model: its options, hooks and per-call facts."""

    def __init__(self, root: nn.Module, options: MergeOptions) -> None:
        self.root = root
        self.options = options
        self.progress: float | None = None
        self.timestep: torch.Tensor | float | None = None
        self._tbits: torch.Tensor | None = None
        # This U-Net call's random partitions, laid out for its batch: one per selected block, by (grid, batch,
        # device, dtype); and the fixed partition's, kept while patched.
        self._partitions: dict[tuple, list[SplitLayout]] = {}
        self._fixed_layouts: dict[tuple, list[SplitLayout]] = {}
        self._keys: dict[torch.device, torch.Tensor] = {}
        self._handles: list = []
        # (attn1, the forward this patch set on it): modules whose calls this patch computes itself.
        self._own_attention: list[tuple[nn.Module, BiasedAttention]] = []
        # Block calls whose plan no attention call could use, and attention calls run unmerged because their
        # input was not laid out as the plan's (other extensions reshaping or splitting the tokens, an attn1
        # replacement): the host tells the user once per job.
        self.unmerged_calls = 0
        self.unused_plans = 0
        self.records: list[_BlockRecord] = []
        self.selected: list[_BlockRecord] = []
        # The local and stack methods' plans: this U-Net call's, by level; and those kept for reuse across
        # sampling evaluations, by (level, call slot within the evaluation, h, w). See ``_begin_level_call``.
        family = family_of(root)
        if family is None:  # no transformer of any family: refused, never taken for ldm
            raise nothing_to_patch(root)
        self.family = family
        self._has_call_hook = self.family.is_unet(root)
        self._level_plans: dict[int, LocalPlan | StackPlan | None] = {}
        self._stacks_under_way: list[list] = []
        self._kept_plans: dict[tuple, LocalPlan | None] = {}
        self._evaluation = -1
        self._call_slot: int | None = None
        self._last_progress: float | None = None
        self._fresh = True

        layout = self.family.transformer_levels(root)
        blocks = [(tname, t, level, i, blk) for tname, t, level in layout
                  for i, blk in enumerate(t.transformer_blocks) if _is_block(blk)]
        if not blocks:
            raise nothing_to_patch(root)
        # Each selected block's record, grouped by the transformer whose input tells its grid.
        self._grid_sources: dict[int, tuple[nn.Module, list[_BlockRecord]]] = {}
        for index, (tname, t, level, i, blk) in enumerate(blocks):
            self.records.append(_BlockRecord(f"{tname}.transformer_blocks.{i}", index, level, blk, self.family))
        levels = sorted({r.level for r in self.records})
        if options.max_downsample is None:
            wanted = {levels[0]}
        else:
            wanted = {lv for lv in levels if 2 ** lv <= options.max_downsample}
        for rec, (_, t, *_) in zip(self.records, blocks):
            if rec.level in wanted:
                rec.row = len(self.selected)
                self.selected.append(rec)
                self._grid_sources.setdefault(id(t), (t, []))[1].append(rec)

    # -- installation -------------------------------------------------------------------------------------

    def install(self) -> None:
        o = self.options
        seed = DEFAULT_SEED if o.seed is None else o.seed
        hook = self._hook
        family = self.family
        if self._has_call_hook:
            hook(self.root.register_forward_pre_hook(self._record_timestep, with_kwargs=True))
        for t, recs in self._grid_sources.values():
            hook(t.register_forward_pre_hook(_grid_recorder(recs, family.tokens_keyword), with_kwargs=True))
        if o.method in WINDOW_METHODS and self._has_call_hook:
            hook(self.root.register_forward_pre_hook(self._begin_level_call, with_kwargs=True))
        if o.method == "stack":
            self._install_stacks()
            return
        for rec in self.selected:
            rec.key = host_key(seed, rec.index)
            blk = rec.module
            hook(blk.register_forward_pre_hook(_plan_maker(self, rec), with_kwargs=True))
            hook(blk.register_forward_hook(_plan_dropper(self, rec)))
            if self.weighs_keys and rec.self_attention and family.bias_keyword is None:
                forward = family.biased_attention(blk.attn1, rec.take_key_bias)
                blk.attn1.forward = forward
                self._own_attention.append((blk.attn1, forward))
            if o.method in ("todo", "local"):
                hook(blk.attn1.register_forward_pre_hook(_kv_reducer(self, rec, o), with_kwargs=True))
                continue
            for wanted, sub, self_attention in ((o.merge_attn, blk.attn1, rec.self_attention),
                                                (o.merge_crossattn, blk.attn2, False), (o.merge_mlp, blk.ff, False)):
                if wanted and isinstance(sub, nn.Module):  # diffusers blocks without text have attn2 None
                    merged_calls: list[bool] = []  # this module's calls under way: merged or not
                    hook(sub.register_forward_pre_hook(_merger(self, rec, self_attention, merged_calls),
                                                       with_kwargs=True))
                    hook(sub.register_forward_hook(_unmerger(rec, merged_calls)))

    def _install_stacks(self) -> None:
        """The stack method's hooks: on each selected transformer's first block (merge by the level's plan)
        and its last (restore); every block in between runs on the merged tokens as it is."""
        keyword = self.family.tokens_keyword
        for _, recs in self._grid_sources.values():
            under_way: list = []  # this stack's calls under way: (plan, offsets, merged shape), or None
            self._stacks_under_way.append(under_way)
            self._hook(recs[0].module.register_forward_pre_hook(_stack_entry(self, recs[0], under_way, keyword),
                                                                with_kwargs=True))
            self._hook(recs[-1].module.register_forward_hook(_stack_exit(self, under_way)))

    @property
    def blocks(self) -> tuple[PatchedBlock, ...]:
        """The blocks this patch acts on, in call order."""
        return tuple(PatchedBlock(rec.name, rec.level, rec.module, rec.module.attn1 if rec.self_attention else None)
                     for rec in self.selected)

    def _hook(self, handle) -> None:
        self._handles.append(handle)

    @property
    def weighs_keys(self) -> bool:
        """Size-weighted keys are on, for a method whose keys stand for groups of unequal size (ToDo's all
        stand for f² tokens: the same log added to every logit changes nothing)."""
        return self.options.size_weighted_keys and self.options.method in ("tome", "local")

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, ours in self._own_attention:
            if module.__dict__.get("forward") is ours:
                if ours.previous is None:
                    del module.forward
                else:  # another extension's forward on the instance (Hypertile's) before ours: give it back
                    module.forward = ours.previous
        self._own_attention.clear()
        for rec in self.records:
            rec.plan = None
            rec.grid = None
        self._level_plans.clear()
        self._kept_plans.clear()
        self._stacks_under_way.clear()
        self._partitions.clear()
        self._fixed_layouts.clear()

    # -- per call -----------------------------------------------------------------------------------------

    def _record_timestep(self, module, args, kwargs):
        self.timestep = slot_value(args, kwargs, *self.family.timestep_slot)
        self._tbits = None
        self._partitions.clear()

    def timestep_bits(self, device: torch.device) -> torch.Tensor:
        if self._tbits is None or self._tbits.device != device:
            self._tbits = timestep_words(self.timestep, device)
        return self._tbits

    def partition_layouts(self, h: int, w: int, batch: int, device: torch.device,
                          idt: torch.dtype) -> list[SplitLayout]:
        """The partitions of an h×w grid laid out for ``batch`` rows: with the random partition one per
        selected block (item k for selected block k), for this U-Net call only, made at the first block that
        needs them in one pass of tensor ops for all blocks (on a GPU, per-block tensor ops would cost host
        time that the step waits on); with the fixed one a single item, kept while patched."""
        o = self.options
        cache = self._partitions if o.use_rand else self._fixed_layouts
        cache_key = (h, w, batch, device, idt)
        found = cache.get(cache_key)
        if found is None:
            if o.use_rand:
                keys = self._keys.get(device)
                if keys is None:
                    keys = self._keys[device] = torch.tensor([r.key for r in self.selected], dtype=torch.int32,
                                                             device=device)
                choice = cell_choices(keys, self.timestep_bits(device), (h // o.sy) * (w // o.sx), o.sx * o.sy)
                src, dst = partition(h, w, o.sx, o.sy, choice, idt)
            else:
                src, dst = fixed_partition(h, w, o.sx, o.sy, device, idt)
            found = cache[cache_key] = split_layouts(src, dst, batch, h * w)
        return found

    def _begin_level_call(self, module, args, kwargs):
        """A new U-Net call: forget this call's plans (and a stack left under way by a call that raised), and
        place the call among the sampling evaluations.

        Evaluations are told apart by the sampling progress the host reports (``set_progress``): calls with
        the same progress belong to one evaluation (cond and uncond apart, or a second-order step's two
        evaluations) and are numbered by their order in it (the call slot); a lower progress starts a new
        run. Every ``local_replan``-th evaluation of a run makes fresh plans; the others reuse the plan of
        their call slot. The host's progress rather than the timestep: reading a device timestep would make
        the host wait for the device. Without progress, or with ``local_replan`` 1, every call plans anew.
        """
        self._level_plans.clear()
        for under_way in self._stacks_under_way:
            under_way.clear()
        every = self.options.local_replan
        progress = self.progress
        if progress is None or every <= 1:
            self._call_slot, self._fresh = None, True
            self._kept_plans.clear()
            return
        if self._last_progress is None or progress < self._last_progress:
            self._evaluation, self._call_slot = 0, 0
            self._kept_plans.clear()
        elif progress == self._last_progress:
            self._call_slot += 1
        else:
            self._evaluation, self._call_slot = self._evaluation + 1, 0
        self._last_progress = progress
        self._fresh = self._evaluation % every == 0

    def level_plan(self, rec: _BlockRecord, x: torch.Tensor) -> LocalPlan | StackPlan | None:
        """The local or stack plan of ``rec``'s level for this call: made from the first patched block (the
        first stack) of the level that the call reaches (and kept, or taken from an earlier evaluation, per
        ``_begin_level_call``); None outside the step window, at ratio 0, or when ``x`` is not the level's h×w
        tokens."""
        o = self.options
        if (rec.grid is None or not o.in_window(self.progress) or not isinstance(x, torch.Tensor)
                or x.dim() != 3 or o.ratio <= 0):
            return None
        h, w = rec.grid
        if x.shape[1] != h * w:
            return None
        idt = o.index_dtype or default_index_dtype(x.device)
        sizes = self.weighs_keys

        def fresh_plan() -> LocalPlan | StackPlan | None:
            if o.method == "stack":
                return plan_stack(x, h, w, o.ratio, idt)
            return plan_local(x, h, w, o.ratio, idt, sizes)

        if not self._has_call_hook:  # a lone transformer: no call boundary to share a plan within
            return fresh_plan()
        if rec.level in self._level_plans:
            plan = self._level_plans[rec.level]
            return plan if plan is not None and plan.fits(x) else None
        key = (rec.level, self._call_slot, h, w)
        plan = None
        if self._call_slot is not None and not self._fresh:
            kept = self._kept_plans.get(key)
            plan = kept if kept is not None and kept.fits(x) else None
        if plan is None:
            plan = fresh_plan()
            if self._call_slot is not None:
                self._kept_plans[key] = plan
        self._level_plans[rec.level] = plan
        return plan

    def make_plan(self, rec: _BlockRecord, x: torch.Tensor):
        o = self.options
        if o.method == "local":
            return self.level_plan(rec, x) if rec.self_attention else None
        if rec.grid is None or not o.in_window(self.progress) or x is None or x.dim() != 3:
            return None
        h, w = rec.grid
        tokens = x.shape[1]
        if tokens != h * w:
            return None
        if o.method == "todo":
            return _TODO if o.todo_factor > 1 and rec.self_attention else None
        r = int(tokens * o.ratio)
        cells = (h // o.sy) * (w // o.sx)
        if r <= 0 or cells == 0:
            return None
        idt = o.index_dtype or default_index_dtype(x.device)
        layouts = self.partition_layouts(h, w, x.shape[0], x.device, idt)
        layout = layouts[rec.row] if o.use_rand else layouts[0]
        return plan_split(x, layout, r, o.score_chunk_elements or default_score_chunk(x.device))


def default_index_dtype(device: torch.device) -> torch.dtype:
    """int32 on Apple's MPS, whose int64 support is partial (no negation, some gathers); int64 elsewhere."""
    return torch.int32 if device.type == "mps" else torch.int64


def default_score_chunk(device: torch.device) -> int:
    """Similarity scores held at once while finding a merge: 4 Mi on the CPU, where smaller chunks stay fast,
    and 64 Mi on accelerators, where many small matmuls would cost launches (128 MiB in fp16)."""
    return 1 << 22 if device.type == "cpu" else 1 << 26


def _grid_recorder(recs: list[_BlockRecord], keyword: str):
    def hook(module, args, kwargs):
        x = first_arg(args, kwargs, keyword)
        grid = (int(x.shape[-2]), int(x.shape[-1])) if isinstance(x, torch.Tensor) and x.dim() == 4 else None
        for rec in recs:
            rec.grid = grid
    return hook


def _plan_maker(patch: TokenMergePatch, rec: _BlockRecord):
    keyword = patch.family.tokens_keyword

    def hook(module, args, kwargs):
        x = first_arg(args, kwargs, keyword)
        rec.plan = patch.make_plan(rec, x)
        rec.used = False
        if rec.plan is not None:
            rec.layout = (int(x.shape[0]), int(x.shape[1]))
    return hook


def _plan_dropper(patch: TokenMergePatch, rec: _BlockRecord):
    def hook(module, args, output):
        if rec.plan is not None and not rec.used:
            patch.unused_plans += 1
        rec.plan = None
        rec.key_bias = None  # a bias no attn1 call took (an attn1 replacement) must not reach the next call
    return hook


def _fits(rec: _BlockRecord, x) -> bool:
    """``x`` is laid out as the block input the block's plan (ToDo: its grid) was made for: same batch rows,
    same tokens."""
    return isinstance(x, torch.Tensor) and x.dim() == 3 and (x.shape[0], x.shape[1]) == rec.layout


def _merged_arguments(merge, args, kwargs, x: torch.Tensor, self_attention: bool, family: Family):
    """The call's arguments with ``x`` merged, and with it self-attention's explicit key/value sources."""
    done = {id(x): merge(x)}
    args, kwargs = list(args), dict(kwargs)
    set_slot(args, kwargs, 0, family.tokens_keyword, done[id(x)])
    if self_attention:
        _map_kv_sources(args, kwargs, x, merge, done, family.kv_slots)
    return tuple(args), kwargs


def _per_token(t, x: torch.Tensor) -> bool:
    """``t`` holds one row per token of ``x`` (so a merge plan or the token grid applies to it)."""
    return isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] == x.shape[:2]


def _map_kv_sources(args: list, kwargs: dict, x: torch.Tensor, fn, done: dict, slots: tuple) -> None:
    """Apply ``fn`` in place to each explicitly passed key/value source that has one row per token of ``x``;
    ``done`` maps ids of tensors already mapped (Forge passes the same tensor as x, context and value).
    Sources of another length (text, extra reference tokens) stay as they are. ``slots``: the family's
    ``kv_slots``."""
    for index, name in slots:
        t = slot_value(args, kwargs, index, name)
        if not _per_token(t, x):
            continue
        if id(t) not in done:
            done[id(t)] = fn(t)
        set_slot(args, kwargs, index, name, done[id(t)])


def _merger(patch: TokenMergePatch, rec: _BlockRecord, self_attention: bool, merged_calls: list[bool]):
    family = patch.family

    def hook(module, args, kwargs):
        plan = rec.plan
        if plan is None or plan is _TODO:
            merged_calls.append(False)
            return None
        x = first_arg(args, kwargs, family.tokens_keyword)
        if not (isinstance(x, torch.Tensor) and plan.fits(x)):
            # Called on rows or tokens the plan was not made for (ControlNet's reference mode attends with the
            # unconditional rows alone, HyperTile tiles the tokens): exact attention on that input.
            patch.unmerged_calls += 1
            merged_calls.append(False)
            return None
        rec.used = True
        merged_calls.append(True)
        args, kwargs = _merged_arguments(plan.merge, args, kwargs, x, self_attention, family)
        if self_attention and patch.weighs_keys:
            _add_key_bias(family, rec, kwargs, plan.key_log_sizes(x.dtype))
        return args, kwargs
    return hook


def _unmerger(rec: _BlockRecord, merged_calls: list[bool]):
    def hook(module, args, output):
        # The call that ends now is the innermost one under way (a module's calls nest, never interleave).
        merged = merged_calls.pop() if merged_calls else False
        if not merged or rec.plan is None or rec.plan is _TODO:
            return None
        return rec.plan.unmerge(output)
    return hook


def _stack_entry(patch: TokenMergePatch, rec: _BlockRecord, under_way: list, keyword: str):
    """The first block of a stack: its tokens merged by the level's plan, so that every block runs on them."""
    def hook(module, args, kwargs):
        x = first_arg(args, kwargs, keyword)
        plan = patch.level_plan(rec, x)
        if plan is None:
            under_way.append(None)
            return None
        merged = plan.merge(x)
        under_way.append((plan, plan.offsets(x, merged), merged.shape))
        args, kwargs = list(args), dict(kwargs)
        set_slot(args, kwargs, 0, keyword, merged)
        return tuple(args), kwargs
    return hook


def _stack_exit(patch: TokenMergePatch, under_way: list):
    """The last block of a stack: its output on the merged tokens back to every token (``StackPlan.restore``)."""
    def hook(module, args, output):
        entry = under_way.pop() if under_way else None
        if entry is None:
            return None
        plan, offsets, merged_shape = entry
        if not (isinstance(output, torch.Tensor) and output.shape == merged_shape):
            # Another extension gave the stack's tokens back itself (or changed them): its output stands.
            patch.unmerged_calls += 1
            return None
        return plan.restore(offsets, output)
    return hook


def _kv_reducer(patch: TokenMergePatch, rec: _BlockRecord, options: MergeOptions):
    """Self-attention's keys and values from fewer tokens, queries whole: ToDo's downsampled grid, or the
    tokens the local plan keeps."""
    family = patch.family
    kv_source = family.kv_slots[0]

    def hook(module, args, kwargs):
        plan = rec.plan
        if plan is None or not rec.self_attention:
            return None
        x = first_arg(args, kwargs, family.tokens_keyword)
        if not _fits(rec, x) or (plan is not _TODO and not plan.fits(x)):
            # See _merger: exact attention on an input the block's plan does not describe.
            patch.unmerged_calls += 1
            return None
        rec.used = True
        h, w = rec.grid

        def downsample(t: torch.Tensor) -> torch.Tensor:
            if plan is not _TODO:
                return plan.merge(t)
            return downsample_tokens(t, h, w, options.todo_factor, options.todo_pool)

        args, kwargs = list(args), dict(kwargs)
        if slot_value(args, kwargs, *kv_source) is None:  # keys and values would come from x itself
            set_slot(args, kwargs, *kv_source, downsample(x))
        else:
            _map_kv_sources(args, kwargs, x, downsample, {}, family.kv_slots)
        if plan is not _TODO and patch.weighs_keys:
            _add_key_bias(family, rec, kwargs, plan.key_log_sizes(x.dtype))
        return tuple(args), kwargs
    return hook


def _add_key_bias(family: Family, rec: _BlockRecord, kwargs: dict, log_sizes: torch.Tensor) -> None:
    """Hand self-attention's call the log of the tokens each key stands for (B, M), added to every query's
    logit for that key: the family's bias argument (B, 1, M), where its attention takes one and the caller
    passed none; else the record, which the family's ``biased_attention`` takes it from."""
    if family.bias_keyword is None:
        rec.key_bias = log_sizes
    elif kwargs.get(family.bias_keyword) is None:
        kwargs[family.bias_keyword] = log_sizes[:, None, :]


# -- public API -----------------------------------------------------------------------------------------------

def apply_patch(model: Any, *, ratio: float = 0.5, max_downsample: int | None = None, sx: int = 2, sy: int = 2,
                use_rand: bool = True, merge_attn: bool = True, merge_crossattn: bool = False,
                merge_mlp: bool = False, seed: int | None = None, index_dtype: torch.dtype | None = None,
                method: str = "tome", todo_factor: int = 2, todo_pool: str = "nearest",
                step_start: float = 0.0, step_end: float = 1.0,
                score_chunk_elements: int | None = None, local_replan: int = 1, size_weighted_keys: bool = False,
                **unknown: Any) -> Any:
    """Patch ``model`` in place for token merging (or downsampling) and return it.

    ``model`` is an LDM/SGM model (with ``.model.diffusion_model``), an ldm/sgm U-Net, a diffusers
    ``UNet2DConditionModel`` or a diffusers pipeline (anything with a ``.unet``: txt2img, img2img, inpaint,
    ControlNet, SDXL base and refiner), or any module tree holding ldm ``SpatialTransformer``s or diffusers
    ``Transformer2DModel``s. Calling it again replaces the settings. All options are validated before the
    model is touched: on a ``TypeError``/``ValueError`` the model is left exactly as it was.

    Args mirror tomesd where the meaning is the same (``ratio`` … ``merge_mlp``), plus:
        max_downsample: None selects the highest-resolution attention level the model has (SDXL's is 2).
        seed: key of the random partition (with ``use_rand``), together with the call's timestep and the
            block; None means a fixed default.
        index_dtype: torch.int32 (MPS-safe) or torch.int64; None picks int32 on ``mps`` and int64 elsewhere.
        method: "tome" (merge tokens), "todo" (downsample self-attention's keys and values) or "local"
            (self-attention's keys and values from the tokens that stand for the groups merged inside 2×2
            windows, by one plan per level and U-Net call; queries whole; see ``tome_core.local``; like
            ToDo it ignores ``merge_crossattn`` and ``merge_mlp``, and it ignores ``sx``, ``sy``,
            ``use_rand`` and ``seed``: its plan is a function of the features), or "stack" (the tokens of
            each selected transformer stack merged once at its entrance by the local method's groups, each
            group the mean of its tokens, every block of the stack run on them, and every token given its own
            input plus what the stack added to its group at the exit; see ``tome_core.stack``; it reads
            ``ratio``, ``max_downsample``, the step window, ``index_dtype`` and ``local_replan``).
        todo_factor, todo_pool: ToDo's downsampling factor per side and "nearest" or "average" pooling.
        step_start, step_end: the window of sampling progress (see ``set_progress``) in which to act.
        score_chunk_elements: upper bound on similarity scores held at once while finding the merge
            (None: 4 Mi on the CPU, 64 Mi on accelerators).
        local_replan: the local and stack methods make fresh plans every this many sampling evaluations and reuses
            them in between (1: every evaluation). Reuse needs the progress ``set_progress`` reports.
        size_weighted_keys: ToMe and Local: a self-attention key that stands for k tokens (a merged group)
            adds log k to its logit, as if its tokens were keys one by one (proportional attention, ToMe for
            ViTs). Off: the paper's ToMe for SD (and tomesd's outputs). ToDo ignores it (its keys all stand
            for f² tokens).
    """
    if unknown:
        allowed = ", ".join(f.name for f in dataclasses.fields(MergeOptions))
        raise TypeError(f"apply_patch got unknown option(s) {', '.join(map(repr, unknown))}; the options are: "
                        f"{allowed}")
    options = MergeOptions(ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand,
                           merge_attn=merge_attn, merge_crossattn=merge_crossattn, merge_mlp=merge_mlp,
                           seed=seed, index_dtype=index_dtype, method=method, todo_factor=todo_factor,
                           todo_pool=todo_pool, step_start=step_start, step_end=step_end,
                           score_chunk_elements=score_chunk_elements, local_replan=local_replan,
                           size_weighted_keys=size_weighted_keys)
    root = resolve_unet(model)
    check_loaded(root)
    patch = TokenMergePatch(root, options)  # raises before anything changes if there is nothing to patch
    remove_patch(root)
    try:
        patch.install()
    except BaseException:
        patch.uninstall()
        raise
    setattr(root, PATCH_ATTR, patch)
    return model


def remove_patch(model: Any) -> Any:
    """Remove every hook and attribute ``apply_patch`` added; a model without our patch is left untouched."""
    root = resolve_unet(model)
    patch = root.__dict__.pop(PATCH_ATTR, None)
    if patch is not None:
        patch.uninstall()
    return model


def get_patch(model: Any) -> TokenMergePatch | None:
    """The live patch of ``model`` (its ``options``, ``blocks``, ``progress``), or None."""
    return getattr(resolve_unet(model), PATCH_ATTR, None)


def patched_blocks(model: Any) -> tuple[PatchedBlock, ...]:
    """The blocks the patch of ``model`` acts on (empty when it has none)."""
    patch = get_patch(model)
    return () if patch is None else patch.blocks


def is_patched(model: Any) -> bool:
    return get_patch(model) is not None


def set_progress(model: Any, progress: float | None) -> None:
    """Tell the patch how far sampling is (0 = first step, 1 = last); None = unknown (always act).

    The patch acts only while ``step_start <= progress <= step_end``. A model without our patch ignores it.
    """
    if progress is not None:
        check_number("progress", progress, 0.0, 1.0)
        progress = float(progress)
    patch = get_patch(model)
    if patch is not None:
        patch.progress = progress
