"""Reversible patching of ldm/sgm U-Nets: forward hooks only, no class swap, nothing global.

Per patched transformer block:
- the enclosing ``SpatialTransformer``'s pre-hook records the block's token grid (h, w) from its input, so the
  grid is known exactly for every latent size and call style;
- the block's pre-hook computes one merge plan from the block input (or nothing outside the step window,
  at ratio 0, or on a level that is not selected), and its post-hook drops it;
- pre/post hooks on ``attn1`` / ``attn2`` / ``ff`` merge their input and unmerge their output (ToMe), or give
  ``attn1`` a reduced key/value source: a downsampled grid (ToDo) or the level's local plan's kept tokens
  (Local).
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

from .local import LocalPlan, plan_local
from .merge import MergePlan, downsample_tokens, plan_merge
from .options import MergeOptions, check_number
from .partition import cell_choices, fixed_partition, host_key, partition, timestep_words

PATCH_ATTR = "_tokenmerge_patch"
DEFAULT_SEED = 0
_TODO = object()  # plan marker: this block call downsamples keys/values on the grid


class _BlockRecord:
    __slots__ = ("name", "index", "level", "module", "self_attention", "grid", "plan", "key", "row", "layout",
                 "used")

    def __init__(self, name: str, index: int, level: int, module: nn.Module) -> None:
        self.name, self.index, self.level, self.module = name, index, level, module
        # attn1 attends to the text instead in blocks built with disable_self_attn.
        self.self_attention = not getattr(module, "disable_self_attn", False)
        self.grid: tuple[int, int] | None = None
        self.plan: MergePlan | object | None = None
        # (batch, tokens) of the block input the plan was made for: an attention call on anything else (a
        # subset of the batch, tiled tokens) runs as it would unpatched.
        self.layout: tuple[int, int] = (0, 0)
        self.used = False  # the plan reached at least one attention or MLP call of this block call
        self.key = 0
        self.row = 0  # its place among the selected blocks: its row of a call's random partitions


def _is_transformer(module: nn.Module) -> bool:
    return type(module).__name__ == "SpatialTransformer" and hasattr(module, "transformer_blocks")


def _is_block(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("attn1", "attn2", "ff", "norm1", "norm2", "norm3"))


def _has_resampler(module: nn.Module, kind: str) -> bool:
    return any(type(m).__name__ == kind for m in module.modules())


def transformer_levels(root: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """Every SpatialTransformer under ``root`` with its downsampling level (0 = latent resolution).

    Levels come from the U-Net's structure (a ``Downsample`` in an input block or an ``Upsample`` in an output
    block changes the level after that block), not from token counts, so they hold for any latent size. A
    module tree that is not an ldm/sgm U-Net has all its transformers at level 0.
    """
    names = {id(m): n for n, m in root.named_modules()}
    found: list[tuple[str, nn.Module, int]] = []

    def collect(container: nn.Module, level: int) -> None:
        for m in container.modules():
            if _is_transformer(m):
                found.append((names.get(id(m), ""), m, level))

    if all(hasattr(root, a) for a in ("input_blocks", "middle_block", "output_blocks")):
        level = 0
        for block in root.input_blocks:
            collect(block, level)
            level += _has_resampler(block, "Downsample")
        collect(root.middle_block, level)
        for block in root.output_blocks:
            collect(block, level)
            level -= _has_resampler(block, "Upsample")
    else:
        collect(root, 0)
    return found


def resolve_unet(model: Any) -> nn.Module:
    """The module to patch: ``model.model.diffusion_model`` (the webui's ``shared.sd_model``) or
    ``model.diffusion_model`` when present, else ``model`` itself."""
    if model is None:
        raise TypeError("model must be a torch.nn.Module (an LDM/SGM model, its U-Net or a module tree "
                        "holding SpatialTransformers), got None")
    # The webui's sd_model (model.model.diffusion_model) or its DiffusionWrapper (model.diffusion_model).
    for inner in (getattr(getattr(model, "model", None), "diffusion_model", None),
                  getattr(model, "diffusion_model", None)):
        if isinstance(inner, nn.Module):
            return inner
    root = model
    if not isinstance(root, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (an LDM/SGM model, its U-Net or a module tree "
                        f"holding SpatialTransformers), got {type(model).__name__}")
    return root


class TokenMergePatch:
    """The live state of one patched model: its options, hooks and per-call facts."""

    def __init__(self, root: nn.Module, options: MergeOptions) -> None:
        self.root = root
        self.options = options
        self.progress: float | None = None
        self.timestep: torch.Tensor | float | None = None
        self._tbits: torch.Tensor | None = None
        # This U-Net call's random partitions, (src, dst) of every selected block, by (grid, device, dtype).
        self._partitions: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._keys: dict[torch.device, torch.Tensor] = {}
        self._handles: list = []
        # Block calls whose plan no attention call could use, and attention calls run unmerged because their
        # input was not laid out as the plan's (other extensions reshaping or splitting the tokens, an attn1
        # replacement): the host tells the user once per job.
        self.unmerged_calls = 0
        self.unused_plans = 0
        self.records: list[_BlockRecord] = []
        self.selected: list[_BlockRecord] = []
        # The local method's plans: this U-Net call's, by level; and those kept for reuse across sampling
        # evaluations, by (level, call slot within the evaluation, h, w). See ``_begin_local_call``.
        self._has_call_hook = hasattr(root, "input_blocks")
        self._level_plans: dict[int, LocalPlan | None] = {}
        self._kept_plans: dict[tuple, LocalPlan | None] = {}
        self._evaluation = -1
        self._call_slot: int | None = None
        self._last_progress: float | None = None
        self._fresh = True

        layout = transformer_levels(root)
        blocks = [(tname, t, level, i, blk) for tname, t, level in layout
                  for i, blk in enumerate(t.transformer_blocks) if _is_block(blk)]
        if not blocks:
            raise ValueError(f"model {type(root).__name__} has no ldm/sgm transformer blocks "
                             f"(SpatialTransformer with BasicTransformerBlocks); SD3/MMDiT and Flux models have "
                             f"no U-Net and cannot be patched")
        # Each selected block's record, grouped by the transformer whose input tells its grid.
        self._grid_sources: dict[int, tuple[nn.Module, list[_BlockRecord]]] = {}
        for index, (tname, t, level, i, blk) in enumerate(blocks):
            self.records.append(_BlockRecord(f"{tname}.transformer_blocks.{i}", index, level, blk))
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
        if hasattr(self.root, "input_blocks"):
            hook(self.root.register_forward_pre_hook(self._record_timestep, with_kwargs=True))
        for t, recs in self._grid_sources.values():
            hook(t.register_forward_pre_hook(_grid_recorder(recs), with_kwargs=True))
        if o.method == "local" and self._has_call_hook:
            hook(self.root.register_forward_pre_hook(self._begin_local_call, with_kwargs=True))
        for rec in self.selected:
            rec.key = host_key(seed, rec.index)
            blk = rec.module
            hook(blk.register_forward_pre_hook(_plan_maker(self, rec), with_kwargs=True))
            hook(blk.register_forward_hook(_plan_dropper(self, rec)))
            if o.method in ("todo", "local"):
                hook(blk.attn1.register_forward_pre_hook(_kv_reducer(self, rec, o), with_kwargs=True))
                continue
            for wanted, sub, self_attention in ((o.merge_attn, blk.attn1, rec.self_attention),
                                                (o.merge_crossattn, blk.attn2, False), (o.merge_mlp, blk.ff, False)):
                if wanted:
                    merged_calls: list[bool] = []  # this module's calls under way: merged or not
                    hook(sub.register_forward_pre_hook(_merger(self, rec, self_attention, merged_calls),
                                                       with_kwargs=True))
                    hook(sub.register_forward_hook(_unmerger(rec, merged_calls)))

    def _hook(self, handle) -> None:
        self._handles.append(handle)

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for rec in self.records:
            rec.plan = None
            rec.grid = None
        self._level_plans.clear()
        self._kept_plans.clear()

    # -- per call -----------------------------------------------------------------------------------------

    def _record_timestep(self, module, args, kwargs):
        self.timestep = args[1] if len(args) > 1 else kwargs.get("timesteps")
        self._tbits = None
        self._partitions.clear()

    def timestep_bits(self, device: torch.device) -> torch.Tensor:
        if self._tbits is None or self._tbits.device != device:
            self._tbits = timestep_words(self.timestep, device)
        return self._tbits

    def random_partitions(self, h: int, w: int, device: torch.device, idt: torch.dtype):
        """(src, dst) of every selected block on an h×w grid for this U-Net call, (K, ·) each, row k for
        selected block k. Made at the first block that needs them, in one pass of tensor ops for all blocks:
        on a GPU, per-block tensor ops would cost host time that the step waits on."""
        cache_key = (h, w, device, idt)
        found = self._partitions.get(cache_key)
        if found is None:
            o = self.options
            keys = self._keys.get(device)
            if keys is None:
                keys = self._keys[device] = torch.tensor([r.key for r in self.selected], dtype=torch.int32,
                                                         device=device)
            choice = cell_choices(keys, self.timestep_bits(device), (h // o.sy) * (w // o.sx), o.sx * o.sy)
            found = self._partitions[cache_key] = partition(h, w, o.sx, o.sy, choice, idt)
        return found

    def _begin_local_call(self, module, args, kwargs):
        """A new U-Net call: forget this call's plans, and place the call among the sampling evaluations.

        Evaluations are told apart by the sampling progress the host reports (``set_progress``): calls with
        the same progress belong to one evaluation (cond and uncond apart, or a second-order step's two
        evaluations) and are numbered by their order in it (the call slot); a lower progress starts a new
        run. Every ``local_replan``-th evaluation of a run makes fresh plans; the others reuse the plan of
        their call slot. The host's progress rather than the timestep: reading a device timestep would make
        the host wait for the device. Without progress, or with ``local_replan`` 1, every call plans anew.
        """
        self._level_plans.clear()
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

    def local_plan(self, rec: _BlockRecord, x: torch.Tensor) -> LocalPlan | None:
        """The plan of ``rec``'s level for this call: made from the first patched block of the level that
        the call reaches (and kept, or taken from an earlier evaluation, per ``_begin_local_call``); None
        outside the step window, at ratio 0, or when ``x`` is not the level's h×w tokens."""
        o = self.options
        if (rec.grid is None or not o.in_window(self.progress) or not isinstance(x, torch.Tensor)
                or x.dim() != 3 or o.ratio <= 0):
            return None
        h, w = rec.grid
        if x.shape[1] != h * w:
            return None
        idt = o.index_dtype or default_index_dtype(x.device)
        if not self._has_call_hook:  # a lone transformer: no call boundary to share a plan within
            return plan_local(x, h, w, o.ratio, idt)
        if rec.level in self._level_plans:
            plan = self._level_plans[rec.level]
            return plan if plan is not None and plan.fits(x) else None
        key = (rec.level, self._call_slot, h, w)
        plan = None
        if self._call_slot is not None and not self._fresh:
            kept = self._kept_plans.get(key)
            plan = kept if kept is not None and kept.fits(x) else None
        if plan is None:
            plan = plan_local(x, h, w, o.ratio, idt)
            if self._call_slot is not None:
                self._kept_plans[key] = plan
        self._level_plans[rec.level] = plan
        return plan

    def make_plan(self, rec: _BlockRecord, x: torch.Tensor):
        o = self.options
        if o.method == "local":
            return self.local_plan(rec, x) if rec.self_attention else None
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
        if o.use_rand:
            src, dst = self.random_partitions(h, w, x.device, idt)
            src, dst = src[rec.row], dst[rec.row]
        else:
            src, dst = fixed_partition(h, w, o.sx, o.sy, x.device, idt)
        return plan_merge(x, src, dst, r, o.score_chunk_elements or default_score_chunk(x.device))


def default_index_dtype(device: torch.device) -> torch.dtype:
    """int32 on Apple's MPS, whose int64 support is partial (no negation, some gathers); int64 elsewhere."""
    return torch.int32 if device.type == "mps" else torch.int64


def default_score_chunk(device: torch.device) -> int:
    """Similarity scores held at once while finding a merge: 4 Mi on the CPU, where smaller chunks stay fast,
    and 64 Mi on accelerators, where many small matmuls would cost launches (128 MiB in fp16)."""
    return 1 << 22 if device.type == "cpu" else 1 << 26


def _first_arg(args, kwargs, name):
    return args[0] if args else kwargs.get(name)


def _grid_recorder(recs: list[_BlockRecord]):
    def hook(module, args, kwargs):
        x = _first_arg(args, kwargs, "x")
        grid = (int(x.shape[-2]), int(x.shape[-1])) if isinstance(x, torch.Tensor) and x.dim() == 4 else None
        for rec in recs:
            rec.grid = grid
    return hook


def _plan_maker(patch: TokenMergePatch, rec: _BlockRecord):
    def hook(module, args, kwargs):
        x = _first_arg(args, kwargs, "x")
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
    return hook


def _fits(rec: _BlockRecord, x) -> bool:
    """``x`` is laid out as the block input the block's plan (ToDo: its grid) was made for: same batch rows,
    same tokens."""
    return isinstance(x, torch.Tensor) and x.dim() == 3 and (x.shape[0], x.shape[1]) == rec.layout


def _merged_arguments(merge, args, kwargs, x: torch.Tensor, self_attention: bool):
    """The call's arguments with ``x`` merged, and with it self-attention's explicit key/value sources."""
    done = {id(x): merge(x)}
    args, kwargs = list(args), dict(kwargs)
    _set_slot(args, kwargs, 0, "x", done[id(x)])
    if self_attention:
        _map_kv_sources(args, kwargs, x, merge, done)
    return tuple(args), kwargs


# Where the keys' and values' source of an attention call can be: ldm and sgm call self-attention with
# context None (keys and values come from x); Forge passes ``context=`` and ``value=`` explicitly as soon as
# any attn1 patch is set (its own token merging, other extensions), usually the very tensor given as x.
_KV_SLOTS = ((1, "context"), (None, "value"))  # (position, keyword); value is keyword-only (Forge's)


def _slot(args, kwargs, index: int | None, name: str):
    return args[index] if index is not None and len(args) > index else kwargs.get(name)


def _set_slot(args: list, kwargs: dict, index: int | None, name: str, value) -> None:
    """Pass ``value`` where the caller passed that argument (by position or keyword), else by keyword."""
    if index is not None and len(args) > index:
        args[index] = value
    else:
        kwargs[name] = value


def _per_token(t, x: torch.Tensor) -> bool:
    """``t`` holds one row per token of ``x`` (so a merge plan or the token grid applies to it)."""
    return isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] == x.shape[:2]


def _map_kv_sources(args: list, kwargs: dict, x: torch.Tensor, fn, done: dict) -> None:
    """Apply ``fn`` in place to each explicitly passed key/value source that has one row per token of ``x``;
    ``done`` maps ids of tensors already mapped (Forge passes the same tensor as x, context and value).
    Sources of another length (text, extra reference tokens) stay as they are."""
    for index, name in _KV_SLOTS:
        t = _slot(args, kwargs, index, name)
        if not _per_token(t, x):
            continue
        if id(t) not in done:
            done[id(t)] = fn(t)
        _set_slot(args, kwargs, index, name, done[id(t)])


def _merger(patch: TokenMergePatch, rec: _BlockRecord, self_attention: bool, merged_calls: list[bool]):
    def hook(module, args, kwargs):
        plan = rec.plan
        if plan is None or plan is _TODO:
            merged_calls.append(False)
            return None
        x = _first_arg(args, kwargs, "x")
        if not (isinstance(x, torch.Tensor) and plan.fits(x)):
            # Called on rows or tokens the plan was not made for (ControlNet's reference mode attends with the
            # unconditional rows alone, HyperTile tiles the tokens): exact attention on that input.
            patch.unmerged_calls += 1
            merged_calls.append(False)
            return None
        rec.used = True
        merged_calls.append(True)
        return _merged_arguments(plan.merge, args, kwargs, x, self_attention)
    return hook


def _unmerger(rec: _BlockRecord, merged_calls: list[bool]):
    def hook(module, args, output):
        # The call that ends now is the innermost one under way (a module's calls nest, never interleave).
        merged = merged_calls.pop() if merged_calls else False
        if not merged or rec.plan is None or rec.plan is _TODO:
            return None
        return rec.plan.unmerge(output)
    return hook


def _kv_reducer(patch: TokenMergePatch, rec: _BlockRecord, options: MergeOptions):
    """Self-attention's keys and values from fewer tokens, queries whole: ToDo's downsampled grid, or the
    tokens the local plan keeps."""
    def hook(module, args, kwargs):
        plan = rec.plan
        if plan is None or not rec.self_attention:
            return None
        x = _first_arg(args, kwargs, "x")
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
        if _slot(args, kwargs, *_KV_SLOTS[0]) is None:  # keys and values would come from x itself
            _set_slot(args, kwargs, *_KV_SLOTS[0], downsample(x))
        else:
            _map_kv_sources(args, kwargs, x, downsample, {})
        return tuple(args), kwargs
    return hook


# -- public API -----------------------------------------------------------------------------------------------

def apply_patch(model: Any, *, ratio: float = 0.5, max_downsample: int | None = None, sx: int = 2, sy: int = 2,
                use_rand: bool = True, merge_attn: bool = True, merge_crossattn: bool = False,
                merge_mlp: bool = False, seed: int | None = None, index_dtype: torch.dtype | None = None,
                method: str = "tome", todo_factor: int = 2, todo_pool: str = "nearest",
                step_start: float = 0.0, step_end: float = 1.0,
                score_chunk_elements: int | None = None, local_replan: int = 1, **unknown: Any) -> Any:
    """Patch ``model`` in place for token merging (or downsampling) and return it.

    ``model`` is an LDM/SGM model (with ``.model.diffusion_model``), a U-Net, or any module tree holding
    ldm/sgm ``SpatialTransformer``s. Calling it again replaces the settings. All options are validated before
    the model is touched: on a ``TypeError``/``ValueError`` the model is left exactly as it was.

    Args mirror tomesd where the meaning is the same (``ratio`` … ``merge_mlp``), plus:
        max_downsample: None selects the highest-resolution attention level the model has (SDXL's is 2).
        seed: key of the random partition (with ``use_rand``), together with the call's timestep and the
            block; None means a fixed default.
        index_dtype: torch.int32 (MPS-safe) or torch.int64; None picks int32 on ``mps`` and int64 elsewhere.
        method: "tome" (merge tokens), "todo" (downsample self-attention's keys and values) or "local"
            (self-attention's keys and values from the tokens that stand for the groups merged inside 2×2
            windows, by one plan per level and U-Net call; queries whole; see ``tome_core.local``; like
            ToDo it ignores ``merge_crossattn`` and ``merge_mlp``, and it ignores ``sx``, ``sy``,
            ``use_rand`` and ``seed``: its plan is a function of the features).
        todo_factor, todo_pool: ToDo's downsampling factor per side and "nearest" or "average" pooling.
        step_start, step_end: the window of sampling progress (see ``set_progress``) in which to act.
        score_chunk_elements: upper bound on similarity scores held at once while finding the merge
            (None: 4 Mi on the CPU, 64 Mi on accelerators).
        local_replan: the local method makes fresh plans every this many sampling evaluations and reuses
            them in between (1: every evaluation). Reuse needs the progress ``set_progress`` reports.
    """
    if unknown:
        allowed = ", ".join(f.name for f in dataclasses.fields(MergeOptions))
        raise TypeError(f"apply_patch got unknown option(s) {', '.join(map(repr, unknown))}; the options are: "
                        f"{allowed}")
    options = MergeOptions(ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand,
                           merge_attn=merge_attn, merge_crossattn=merge_crossattn, merge_mlp=merge_mlp,
                           seed=seed, index_dtype=index_dtype, method=method, todo_factor=todo_factor,
                           todo_pool=todo_pool, step_start=step_start, step_end=step_end,
                           score_chunk_elements=score_chunk_elements, local_replan=local_replan)
    root = resolve_unet(model)
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
    """The live patch of ``model`` (its ``options``, ``selected`` blocks, ``progress``), or None."""
    return getattr(resolve_unet(model), PATCH_ATTR, None)


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
