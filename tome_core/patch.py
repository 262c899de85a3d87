"""Reversible patching of U-Nets (ldm/sgm and diffusers): forward hooks only, no class swap, nothing global.

What differs between the families (which module is a transformer, how its calls name their arguments) is in
``tome_core.families``; what differs between the methods (how they plan, what they hook, what they keep between
calls) is in ``tome_core.methods``, one entry each. ``TokenMergePatch`` is what every method shares:
- the selected blocks, by the options' levels, each with its record (``BlockRecord``);
- the enclosing transformer's pre-hook records its blocks' token grid (h, w) from its input, so the grid is known
  exactly for every latent size and call style;
- sampling progress (``set_progress``) and the step window, and a clock that places each U-Net call among the
  sampling evaluations (``CallClock``);
- the U-Net's own pre-hook, which starts each call (the clock, then the method's ``begin_call``);
- the handles of every hook and the attention forwards it set, removed exactly on restore.
A block the method gives nothing to do runs exactly its original code.

Our markers (``_tokenmerge_patch``) differ from tomesd's (``ToMeBlock``, ``_tome_info``, ``_parent``), so the
webui's built-in ``tomesd.remove_patch`` and ours never undo each other.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from .families import BiasedAttention, first_arg, family_of, nothing_to_patch, resolve_unet
from .methods import Method, method_named
from .methods.base import BlockRecord, CallClock
from .options import MergeOptions, check_number

PATCH_ATTR = "_tokenmerge_patch"


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
    """The live state of one patched model: its options, the selected blocks, progress, and the method's
    behaviour (``method_patch``)."""

    def __init__(self, root: nn.Module, options: MergeOptions) -> None:
        self.root = root
        self.options = options
        self.method: Method = method_named(options.method)
        self.progress: float | None = None
        # What the host said the next U-Net call's batch is made of (``set_call_rows``), and this call's.
        self.next_rows: tuple | None = None
        self.rows: tuple | None = None
        self.clock = CallClock()
        self._handles: list = []
        # (attn1, the forward this patch set on it): modules whose calls this patch computes itself.
        self._own_attention: list[tuple[nn.Module, BiasedAttention]] = []
        # Block calls whose plan no attention call could use, and attention calls run unmerged because their
        # input was not laid out as the plan's (other extensions reshaping or splitting the tokens, an attn1
        # replacement): the host tells the user once per job.
        self.unmerged_calls = 0
        self.unused_plans = 0
        self.records: list[BlockRecord] = []
        self.selected: list[BlockRecord] = []
        family = family_of(root)
        if family is None:  # no transformer of any family: refused, never taken for ldm
            raise nothing_to_patch(root)
        self.family = family
        self.has_call_hook = family.is_unet(root)

        found = [(tname, t, level, i, blk) for tname, t, level in family.transformer_levels(root)
                 for i, blk in enumerate(t.transformer_blocks) if _is_block(blk)]
        if not found:
            raise nothing_to_patch(root)
        for index, (tname, t, level, i, blk) in enumerate(found):
            self.records.append(BlockRecord(f"{tname}.transformer_blocks.{i}", index, level, blk, family))
        levels = sorted({r.level for r in self.records})
        if options.max_downsample is None:
            wanted = self.method.auto_levels(levels)
        else:
            wanted = {lv for lv in levels if 2 ** lv <= options.max_downsample}
        # Each selected transformer with its selected blocks, in call order: its input tells their grid.
        by_transformer: dict[int, tuple[nn.Module, list[BlockRecord]]] = {}
        for rec, (_, t, *_) in zip(self.records, found):
            if rec.level in wanted:
                rec.row = len(self.selected)
                self.selected.append(rec)
                by_transformer.setdefault(id(t), (t, []))[1].append(rec)
        self.transformers: list[tuple[nn.Module, list[BlockRecord]]] = list(by_transformer.values())
        self.method_patch = self.method.behaviour(self)

    # -- installation -------------------------------------------------------------------------------------

    def install(self) -> None:
        if self.has_call_hook:
            self.hook(self.root.register_forward_pre_hook(self._begin_call, with_kwargs=True))
        for t, recs in self.transformers:
            self.hook(t.register_forward_pre_hook(_grid_recorder(recs, self.family.tokens_keyword),
                                                  with_kwargs=True))
        self.method_patch.install()

    def hook(self, handle) -> None:
        """Keep a hook's handle, for the restore."""
        self._handles.append(handle)

    def take_key_bias_in_attention(self, rec: BlockRecord) -> None:
        """Where the family's attention takes no logit bias, run ``rec``'s self-attention with the family's
        ``biased_attention``, which takes the size-weighted keys' bias from the record."""
        if self.family.bias_keyword is None:
            forward = self.family.biased_attention(rec.module.attn1, rec.take_key_bias)
            rec.module.attn1.forward = forward
            self._own_attention.append((rec.module.attn1, forward))

    @property
    def blocks(self) -> tuple[PatchedBlock, ...]:
        """The blocks this patch acts on, in call order."""
        return tuple(PatchedBlock(rec.name, rec.level, rec.module, rec.module.attn1 if rec.self_attention else None)
                     for rec in self.selected)

    @property
    def weighs_keys(self) -> bool:
        """Size-weighted keys are on, for a method whose keys stand for groups of unequal size (ToDo's all
        stand for f² tokens: the same log added to every logit changes nothing)."""
        return self.options.size_weighted_keys and self.method.weighs_keys

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
        self.method_patch.uninstall()

    # -- per call -----------------------------------------------------------------------------------------

    def _begin_call(self, module, args, kwargs):
        self.rows, self.next_rows = self.next_rows, None
        self.clock.tick(self.progress, self.rows)
        self.method_patch.begin_call(args, kwargs)

    def acts_on(self, rec: BlockRecord, x: Any) -> bool:
        """Whether ``rec``'s call on input ``x`` is one a method may act on: inside the step window, on the
        block's h×w grid of tokens (B, h·w, C)."""
        if rec.grid is None or not self.options.in_window(self.progress):
            return False
        h, w = rec.grid
        return isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == h * w


def _grid_recorder(recs: list[BlockRecord], keyword: str):
    def hook(module, args, kwargs):
        x = first_arg(args, kwargs, keyword)
        grid = (int(x.shape[-2]), int(x.shape[-1])) if isinstance(x, torch.Tensor) and x.dim() == 4 else None
        for rec in recs:
            rec.grid = grid
    return hook


# -- public API -----------------------------------------------------------------------------------------------

def _unknown_options(names) -> TypeError:
    allowed = ", ".join(f.name for f in dataclasses.fields(MergeOptions))
    return TypeError(f"apply_patch got unknown option(s) {', '.join(map(repr, names))}; the options are: {allowed}")


def apply_patch(model: Any, *, ratio: float = 0.5, max_downsample: int | None = None, sx: int = 2, sy: int = 2,
                use_rand: bool = True, merge_attn: bool = True, merge_crossattn: bool = False,
                merge_mlp: bool = False, seed: int | None = None, index_dtype: torch.dtype | None = None,
                method: str = "tome", todo_factor: int = 2, todo_pool: str = "nearest",
                step_start: float = 0.0, step_end: float = 1.0,
                score_chunk_elements: int | None = None, local_replan: int = 1, size_weighted_keys: bool = False,
                cache_interval: int = 8, cache_warmup: int = 2, **unknown: Any) -> Any:
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
        method: one of ``tome_core.methods.METHOD_NAMES``, each a module of ``tome_core.methods``: "tome"
            (merge tokens), "todo" (downsample self-attention's keys and values), "local" (self-attention's
            keys and values from the tokens that stand for the groups merged inside 2×2 windows, by one plan
            per level and U-Net call; queries whole; see ``tome_core.local``; like ToDo it ignores
            ``merge_crossattn`` and ``merge_mlp``, and it ignores ``sx``, ``sy``, ``use_rand`` and ``seed``:
            its plan is a function of the features), or "stack" (the tokens of each selected transformer
            stack merged once at its entrance by the local method's groups, each group the mean of its
            tokens, every block of the stack run on them, and every token given its own input plus what the
            stack added to its group at the exit; see ``tome_core.stack``; it reads ``ratio``,
            ``max_downsample``, the step window, ``index_dtype`` and ``local_replan``), or "cache" (each selected
            transformer stack run whole on the full steps and skipped on the steps between, where every token
            gets the stack's output at the last full step moved by the stack's fitted gain times its own input's
            move since then; see ``tome_core.methods.cache``; it reads ``max_downsample``, the step window,
            ``cache_interval`` and ``cache_warmup``). With ``max_downsample`` None each method selects the levels where it gains: the
            highest-resolution attention level; for Stack also SDXL's second level; for Cache every level below
            the highest-resolution one (SDXL: its deep level alone).
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
        cache_interval, cache_warmup: Cache's full steps: the first ``cache_warmup`` sampling steps, then
            steps ever further apart, the gaps growing 2, 4, 6 ... up to ``cache_interval`` (with the defaults
            steps 0, 1, 3, 7, 13, 21, 29 ...); the others reuse. Steps are told by ``set_progress``, or where
            it is never called by the U-Net call's timestep.
    """
    if unknown:
        raise _unknown_options(unknown)
    options = MergeOptions(ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand,
                           merge_attn=merge_attn, merge_crossattn=merge_crossattn, merge_mlp=merge_mlp,
                           seed=seed, index_dtype=index_dtype, method=method, todo_factor=todo_factor,
                           todo_pool=todo_pool, step_start=step_start, step_end=step_end,
                           score_chunk_elements=score_chunk_elements, local_replan=local_replan,
                           size_weighted_keys=size_weighted_keys, cache_interval=cache_interval,
                           cache_warmup=cache_warmup)
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


def check_patch(model: Any, **options: Any) -> tuple[PatchedBlock, ...]:
    """The blocks ``apply_patch(model, **options)`` would act on (empty where its levels select none), without
    touching ``model``: raises exactly as ``apply_patch`` would (unknown or bad options, a model with nothing to
    patch or not in memory). For a host that checks a setting where the user makes it, long before a run."""
    keywords = {name: param.default for name, param in inspect.signature(apply_patch).parameters.items()
                if param.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = [name for name in options if name not in keywords]
    if unknown:
        raise _unknown_options(unknown)
    merged = MergeOptions(**{**keywords, **options})
    root = resolve_unet(model)
    check_loaded(root)
    return TokenMergePatch(root, merged).blocks


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


def start_afresh(model: Any) -> None:
    """Forget what the patch keeps from earlier calls (what Cache keeps), so that its next call runs whole.

    For a host that loads other weights into the patched modules within a run (the A1111 WebUI's refiner when
    it shares the base model's config): a change made by the old weights must not be applied with the new.
    A new run, image size or patch starts afresh without it. A model without our patch ignores it.
    """
    patch = get_patch(model)
    if patch is not None:
        patch.method_patch.start_afresh()


def set_call_rows(model: Any, rows: Any) -> None:
    """Tell the patch what the next U-Net call's batch is made of: ``rows`` has one hashable per equal part of
    the batch, in order (ComfyUI: cond or uncond and the condition's id), or is None (not told).

    What a method keeps between calls (Cache) is then kept per part and found again by that name, whether the
    host runs the parts in one call or apart, in any order, so an image never depends on how its host split
    the calls. Told for one call only: a call the host says nothing about is placed by its slot. A model
    without our patch ignores it.
    """
    if rows is not None:
        rows = tuple(rows)
        if not rows:
            raise ValueError("rows must name at least one part of the batch, or be None")
        for row in rows:
            hash(row)  # TypeError for an unhashable name, before anything is kept under it
    patch = get_patch(model)
    if patch is not None:
        patch.next_rows = rows


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
