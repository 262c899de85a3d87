"""The node pack in-process, in the pinned ComfyUI: its nodes as ComfyUI loads them, sampled through ComfyUI's own
sampling code (``common_ksampler``, ``sample_custom``) on small random-weight SD 1.5- and SDXL-shaped U-Nets
built with ComfyUI's classes.

What a run must do is checked against independent expectations: the plain model's own pixels (a branch
without the node), the samplers' own structure (how many evaluations each step makes), Cache's schedule rule,
and the same run with cond and uncond in one call.
"""

from __future__ import annotations

import logging

import pytest
import torch

import comfy.model_management
import comfy.sample
import comfy.samplers
import nodes
from comfy_models import conditioning, tiny_model

STEPS = 6


def latent(batch: int = 1, size: int = 32) -> dict:
    return {"samples": torch.zeros(batch, 4, size, size)}


def ksample(model, layout: str, *, steps: int = STEPS, sampler: str = "euler", seed: int = 1, cfg: float = 7.0,
            batch: int = 1, positive=None, denoise: float = 1.0, samples=None, batch_index=None) -> torch.Tensor:
    """What a KSampler node computes."""
    pos = conditioning(layout, 10) if positive is None else positive
    lat = latent(batch) if samples is None else {"samples": samples}
    if batch_index is not None:
        lat["batch_index"] = batch_index
    return nodes.common_ksampler(model, seed, steps, cfg, sampler, "normal", pos, conditioning(layout, 20), lat,
                                 denoise=denoise)[0]["samples"]


def defaults(node) -> dict:
    return {k: v[1]["default"] for k, v in node.INPUT_TYPES()["required"].items() if k != "model"}


def advanced(pack, model, **values):
    node = pack.tokenmerge_comfy.nodes.TokenMergingAdvanced
    return node().patch(model, **{**defaults(node), **values})[0]


def is_patched(pack, model) -> bool:
    return pack.tome_core.is_patched(model.model.diffusion_model)


class CallLog:
    """A pre-hook on the U-Net recording, for each call, the live patch's progress and what it was told the
    batch holds (None entries: the U-Net was not patched)."""

    def __init__(self, pack, model) -> None:
        self.engine = pack.tome_core
        self.calls: list = []
        self.unet = model.model.diffusion_model
        self.handle = self.unet.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        patch = self.engine.get_patch(module)
        self.calls.append(None if patch is None else (patch.progress, patch.next_rows, int(args[0].shape[0])))

    def remove(self) -> None:
        self.handle.remove()


# -- the nodes as ComfyUI lists them ----------------------------------------------------------------------------

def test_the_pack_loads_through_comfyuis_loader_and_its_inputs_come_from_the_tables(pack):
    engine, settings = pack.tome_core, pack.tome_core.settings
    simple = nodes.NODE_CLASS_MAPPINGS["TokenMerging"]
    full = nodes.NODE_CLASS_MAPPINGS["TokenMergingAdvanced"]
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["TokenMerging"].startswith("Token Merging")
    inputs = full.INPUT_TYPES()["required"]
    assert list(inputs) == ["model"] + [p.key for p in settings.PARAMS if p.engine]
    assert inputs["method"][0] == [m.label for m in engine.METHODS] == ["ToMe", "ToDo", "Local", "Stack", "Cache"]
    for param in settings.PARAMS:
        if param.engine and param.kind in (settings.FLOAT, settings.INT):
            spec = inputs[param.key][1]
            assert (spec["min"], spec["max"], spec["default"]) == (param.low, param.high, param.default)
    # Each method's own options say which method reads them; the hints are the WebUI's.
    assert "read by Cache only" in inputs["cache_interval"][1]["tooltip"]
    assert inputs["ratio"][1]["tooltip"].startswith("Fraction of tokens merged")
    assert simple.INPUT_TYPES()["required"]["method"][0] == ["Recommended", "ToMe", "ToDo", "Local", "Stack", "Cache"]


def test_a_method_added_to_the_table_appears_in_the_nodes(pack, monkeypatch):
    nodes_module, base = pack.tokenmerge_comfy.nodes, pack.tome_core.methods.base
    settings = pack.tome_core.settings
    extra = base.Method("newone", "NewOne", ("new_option",), pack.tome_core.methods.todo.METHOD.behaviour)
    method = settings.Param("method", settings.CHOICE, "tome", "Merge method", "ToMe method", "[ToMe] Method",
                            choices=tuple(m.label for m in pack.tome_core.METHODS) + ("NewOne",))
    option = settings.Param("new_option", settings.INT, 3, "New option", "ToMe new option", None, 1, 9, 1)
    params = tuple(method if p.key == "method" else p for p in settings.PARAMS) + (option,)
    monkeypatch.setattr(pack.tome_core, "METHODS", pack.tome_core.METHODS + (extra,))
    monkeypatch.setattr(settings, "PARAMS", params)
    monkeypatch.setattr(settings, "PARAM", {p.key: p for p in params})
    monkeypatch.setattr(nodes_module, "ENGINE_PARAMS", tuple(p for p in params if p.engine))
    inputs = nodes_module.TokenMergingAdvanced.INPUT_TYPES()["required"]
    assert "NewOne" in inputs["method"][0] and inputs["new_option"][0] == "INT"
    assert "read by NewOne only" in inputs["new_option"][1]["tooltip"]
    assert "NewOne" in nodes_module.TokenMerging.INPUT_TYPES()["required"]["method"][0]


# -- scoped to each sampling run --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["sd15", "sdxl"])
@pytest.mark.parametrize("method", ["ToMe", "ToDo", "Local", "Stack", "Cache"])
def test_only_the_run_that_asked_is_merged_and_the_plain_branch_keeps_its_pixels(pack, layout, method):
    model = tiny_model(layout)
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.model.named_modules()}
    plain = ksample(model, layout)
    merged_model = advanced(pack, model, method=method)
    assert not is_patched(pack, model)  # the node itself patches nothing: ComfyUI shares the module
    log = CallLog(pack, merged_model)
    merged = ksample(merged_model, layout)
    log.remove()
    assert log.calls and all(call is not None for call in log.calls)  # every call of its run was patched
    assert not is_patched(pack, model)
    assert not torch.equal(merged, plain)
    assert torch.equal(ksample(model, layout), plain)  # the same module, sampled without the node
    assert hooks == {name: (len(m._forward_hooks), len(m._forward_pre_hooks))
                     for name, m in model.model.named_modules()}
    assert not any("forward" in m.__dict__ for m in model.model.modules())
    assert torch.equal(ksample(merged_model, layout), merged)  # and the node's run is reproducible


def test_a_run_that_fails_or_is_interrupted_leaves_nothing_patched(pack):
    model = tiny_model("sd15")
    plain = ksample(model, "sd15")
    merged_model = advanced(pack, model, method="Cache")
    want = ksample(merged_model, "sd15")
    for error in (RuntimeError("a node beside it failed"), comfy.model_management.InterruptProcessingException()):
        calls = []

        def fail_at_the_fourth_call(module, args, error=error):
            calls.append(1)
            if len(calls) == 4:
                raise error
        handle = model.model.diffusion_model.register_forward_pre_hook(fail_at_the_fourth_call)
        with pytest.raises(type(error)):
            ksample(merged_model, "sd15")
        handle.remove()
        assert not is_patched(pack, model)
        assert torch.equal(ksample(model, "sd15"), plain)
        assert torch.equal(ksample(merged_model, "sd15"), want)  # nothing kept from the stopped run


# -- progress from the run's sigmas -----------------------------------------------------------------------------

# Evaluations per step, from each sampler's definition: a second-order step evaluates twice, except the last,
# which goes to sigma 0 with a single (Euler) evaluation.
SECOND_ORDER = {"heun": True, "dpm_2": True, "dpmpp_2s_ancestral": True, "euler": False, "euler_ancestral": False,
                "dpmpp_2m": False, "dpmpp_2m_sde": False}


def expected_progress(sampler: str, steps: int, per_evaluation: int = 1) -> list[float]:
    out = []
    for i in range(steps):
        evaluations = 2 if SECOND_ORDER[sampler] and i < steps - 1 else 1
        out += [(i + 0.5) / steps] * (evaluations * per_evaluation)
    return out


# Second-order samplers whose correction of the first step can lie at or below step 1's sigma: the run learns
# how many evaluations a step makes between the first two reports, and until then takes it for step 1's.
LEARNT_AFTER_THE_FIRST_STEP = {"heun", "dpmpp_2s_ancestral"}


def assert_progress(got: list, sampler: str, steps: int) -> None:
    want = expected_progress(sampler, steps)
    assert len(got) == len(want)
    if sampler in LEARNT_AFTER_THE_FIRST_STEP:
        assert got[1] == pytest.approx(want[1]) or got[1] == pytest.approx(want[2])
        got, want = got[:1] + got[2:], want[:1] + want[2:]
    assert got == pytest.approx(want)


@pytest.mark.parametrize("sampler", list(SECOND_ORDER))
def test_each_call_is_told_its_step_with_every_sampler(pack, sampler):
    model = tiny_model("sd15")
    merged_model = advanced(pack, model, method="Cache")
    log = CallLog(pack, merged_model)
    ksample(merged_model, "sd15", sampler=sampler, steps=5)
    log.remove()
    assert_progress([call[0] for call in log.calls], sampler, 5)
    assert all(call[1] is not None and {row[0] for row in call[1]} == {0, 1} for call in log.calls)


def test_custom_sigmas_and_a_partial_denoise_count_their_own_steps(pack):
    model = tiny_model("sd15")
    merged_model = advanced(pack, model, method="ToMe")
    log = CallLog(pack, merged_model)
    sigmas = torch.tensor([9.0, 5.0, 2.5, 1.0, 0.3, 0.0])
    noise = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(3))
    comfy.sample.sample_custom(merged_model, noise, 6.0, comfy.samplers.ksampler("heun"), sigmas,
                               conditioning("sd15", 1), conditioning("sd15", 2), torch.zeros(1, 4, 32, 32), seed=3)
    assert_progress([call[0] for call in log.calls], "heun", 5)
    log.calls.clear()
    ksample(merged_model, "sd15", steps=8, denoise=0.5, samples=torch.randn(1, 4, 32, 32))  # a hires pass
    log.remove()
    steps = 4  # ComfyUI runs the last half of a 16-step schedule... counted as this run's own steps
    assert len(log.calls) >= steps and log.calls[0][0] == pytest.approx(0.5 / len(log.calls))


@pytest.mark.parametrize("scheduler", ["karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta"])
def test_every_scheduler_gives_each_step_its_progress(pack, scheduler):
    model = tiny_model("sd15")
    merged_model = advanced(pack, model, method="Cache")
    log = CallLog(pack, merged_model)
    nodes.common_ksampler(merged_model, 1, 5, 7.0, "dpm_2", scheduler, conditioning("sd15", 10),
                          conditioning("sd15", 20), latent())
    log.remove()
    # The schedule the KSampler runs (for DPM2 it drops a penultimate sigma; with ddim_uniform that leaves a step
    # more than asked).
    sigmas = comfy.samplers.KSampler(model, steps=5, device="cpu", sampler="dpm_2", scheduler=scheduler).sigmas
    assert_progress([call[0] for call in log.calls], "dpm_2", len(sigmas) - 1)


def test_the_step_window_follows_the_runs_progress(pack):
    """A window no evaluation's step lies in (the last of 6 steps is at progress 11/12) leaves the run plain, bit
    for bit; the second half merges."""
    model = tiny_model("sd15")
    plain = ksample(model, "sd15")
    assert torch.equal(ksample(advanced(pack, model, method="ToMe", step_start=0.95, step_end=1.0), "sd15"), plain)
    late = ksample(advanced(pack, model, method="ToMe", step_start=0.5), "sd15")
    assert not torch.equal(late, plain)


def _full_stack_steps(pack, model, sampler: str, steps: int) -> list[int]:
    """The steps at which a stack Cache selects ran its blocks (a hook on its first block)."""
    engine = pack.tome_core
    unet = model.model.diffusion_model
    levels = engine.patch.transformer_levels(unet)
    deep = [t for _, t, lv in levels if lv == max(lv for _, _, lv in levels)][0]
    seen: list[int] = []
    patch_of = engine.get_patch

    def record(module, args):
        seen.append(patch_of(unet).clock.evaluation)
    handle = deep.transformer_blocks[0].register_forward_pre_hook(record)
    merged_model = advanced(pack, model, method="Cache")
    ksample(merged_model, "sdxl", sampler=sampler, steps=steps)
    handle.remove()
    return sorted(set(seen))


@pytest.mark.parametrize("sampler", ["euler", "euler_ancestral", "dpmpp_2m", "dpm_2", "heun"])
def test_caches_full_steps_follow_its_rule_with_every_sampler(pack, sampler):
    model = tiny_model("sdxl")
    rule = pack.tome_core.methods.cache.is_full_step
    want = [i for i in range(10) if rule(i, 2, 8)]
    assert want == [0, 1, 3, 7]
    if sampler == "heun":  # its first correction was taken for step 1's: what was kept is dropped, step 2 runs whole
        want = [0, 1, 2, 3, 7]
    assert _full_stack_steps(pack, model, sampler, 10) == want


# -- what ComfyUI says a call is --------------------------------------------------------------------------------

def _memory_needed(monkeypatch, model, layouts: str) -> None:
    """ComfyUI batches cond and uncond in one call when the memory it estimates the call needs is free: make
    the estimate, call after call, cycle through ``layouts`` ("t": together fits, "a": apart)."""
    calls = iter(layouts * 1000)
    monkeypatch.setattr(model.model, "memory_required",
                        lambda *args, **kwargs: 0 if next(calls) == "t" else float("inf"), raising=False)


# ToMe's choice of which tokens merge is discrete: a float difference between a batched and a split call (the
# plain model's own, 1e-6) can flip one choice, and 8 ancestral steps on a random model grow that into another
# picture. Its calls are equal either way (tests/test_core_random_mps_todo.py); here it runs 2 steps.
@pytest.mark.parametrize("method,sampler,steps", [("ToMe", "euler", 2), ("Cache", "euler_ancestral", 8),
                                                  ("Stack", "euler_ancestral", 8)])
def test_an_image_does_not_depend_on_how_comfyui_split_cond_and_uncond(pack, monkeypatch, method, sampler, steps):
    model = tiny_model("sdxl")
    merged_model = advanced(pack, model, method=method)
    log = CallLog(pack, merged_model)
    together = ksample(merged_model, "sdxl", sampler=sampler, steps=steps)
    assert all(call[2] == 2 for call in log.calls)  # cond and uncond in one call
    plain_together = ksample(model, "sdxl", sampler=sampler, steps=steps)
    log.calls.clear()
    _memory_needed(monkeypatch, model, "a")
    apart = ksample(merged_model, "sdxl", sampler=sampler, steps=steps)
    assert all(call is None or call[2] == 1 for call in log.calls) and len(log.calls) == 2 * steps
    plain_apart = ksample(model, "sdxl", sampler=sampler, steps=steps)
    _memory_needed(monkeypatch, model, "attaat")  # the layout changing mid-run
    mixed = ksample(merged_model, "sdxl", sampler=sampler, steps=steps)
    log.remove()
    plain_gap = (plain_together - plain_apart).abs().max().item()  # the plain model's own float noise
    for other in (apart, mixed):
        assert (together - other).abs().max().item() <= 10 * plain_gap + 1e-4


# The same first image beside two different second ones (ComfyUI draws each image's noise from its batch_index):
# the calls keep their shapes, so the plain model gives the first image bitwise, and so must every method. (Alone
# against batched, the shapes differ and so do the float kernels' sums; ToMe's discrete choices can turn that 1e-6
# into a visible difference on one CPU and not on another.)
@pytest.mark.parametrize("method", ["ToMe", "Cache", "Stack"])
def test_an_image_does_not_depend_on_the_other_images_of_its_batch(pack, method):
    model = tiny_model("sd15")
    merged_model = advanced(pack, model, method=method)
    beside_one = ksample(merged_model, "sd15", batch=2, batch_index=[0, 1])
    beside_another = ksample(merged_model, "sd15", batch=2, batch_index=[0, 5])
    assert not torch.allclose(beside_one[1], beside_another[1], atol=1e-1)  # the second images do differ
    plain = ksample(model, "sd15", batch=2, batch_index=[0, 1])
    assert not torch.allclose(beside_one[0], plain[0], atol=1e-1)  # and the method changes the first
    assert torch.allclose(beside_one[0], beside_another[0], atol=1e-5)


def test_an_image_made_alone_is_the_one_made_in_a_batch_with_cache(pack):
    model = tiny_model("sd15")
    merged_model = advanced(pack, model, method="Cache")
    two = ksample(merged_model, "sd15", batch=2)
    one = ksample(merged_model, "sd15", batch=1)
    assert torch.allclose(two[:1], one, atol=1e-3)


def test_area_conditions_each_keep_their_own_state(pack, monkeypatch):
    """Two prompts, one for the whole picture and one for its left half (ConditioningSetArea): ComfyUI runs
    them in separate calls of different sizes; with Cache each keeps its own state, batched with the uncond or
    apart."""
    model = tiny_model("sd15")
    whole = conditioning("sd15", 10)
    area = nodes.ConditioningSetArea().append(conditioning("sd15", 11), 128, 256, 0, 0, 1.0)[0]
    positive = whole + area
    merged_model = advanced(pack, model, method="Cache", max_downsample=1)
    log = CallLog(pack, merged_model)
    together = ksample(merged_model, "sd15", positive=positive, steps=8)
    assert len({call[1] for call in log.calls if call}) >= 2  # calls that hold different conditions
    _memory_needed(monkeypatch, model, "a")
    apart = ksample(merged_model, "sd15", positive=positive, steps=8)
    log.remove()
    assert not is_patched(pack, model)
    assert torch.allclose(together, apart, atol=1e-3)


# -- beside its neighbours --------------------------------------------------------------------------------------

def test_comfyuis_tomepatchmodel_is_set_aside_in_a_run_with_this_node_in_either_order(pack, builtin_nodes,
                                                                                        caplog):
    tome_patch = builtin_nodes["TomePatchModel"]
    model = tiny_model("sd15")
    ours = ksample(advanced(pack, model, method="ToDo"), "sd15")
    builtin = ksample(tome_patch.execute(model=model, ratio=0.5).result[0], "sd15")
    assert not torch.equal(builtin, ours)
    with caplog.at_level(logging.INFO):
        first_builtin = advanced(pack, tome_patch.execute(model=model, ratio=0.5).result[0], method="ToDo")
        assert torch.equal(ksample(first_builtin, "sd15"), ours)
        ours_first = tome_patch.execute(model=advanced(pack, model, method="ToDo"), ratio=0.5).result[0]
        assert torch.equal(ksample(ours_first, "sd15"), ours)
    lines = [r.getMessage() for r in caplog.records if "TomePatchModel" in r.getMessage()]
    assert len(lines) == 2 and "set aside" in lines[0]
    assert torch.equal(ksample(tome_patch.execute(model=model, ratio=0.5).result[0], "sd15"), builtin)


def test_easycache_is_set_aside_for_a_cache_run_and_kept_for_a_merging_one(pack, builtin_nodes, caplog):
    easycache = builtin_nodes["EasyCache"]
    model = tiny_model("sdxl")

    def with_easycache(m):
        return easycache.execute(model=m, reuse_threshold=3.0, start_percent=0.0, end_percent=1.0,
                                 verbose=False).result[0]
    cache_alone = ksample(advanced(pack, model, method="Cache"), "sdxl", steps=10)
    with caplog.at_level(logging.INFO):
        both = ksample(with_easycache(advanced(pack, model, method="Cache")), "sdxl", steps=10)
    assert torch.equal(both, cache_alone)
    assert any("easycache is set aside" in r.getMessage() for r in caplog.records)
    # A merging method leaves EasyCache running: with its threshold this high it skips steps, so the pixels move.
    tome_alone = ksample(advanced(pack, model, method="ToMe"), "sdxl", steps=10)
    assert not torch.equal(ksample(with_easycache(advanced(pack, model, method="ToMe")), "sdxl", steps=10),
                           tome_alone)


def test_lora_weight_patches_apply_under_the_node(pack):
    """A LoRA is a weight patch on the model clone: the node's run uses the patched weights, and the plain model
    sampled after it is plain again."""
    model = tiny_model("sd15")
    key = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    plain = ksample(model, "sd15")
    delta = 0.5 * torch.randn(model.model.state_dict()[key].shape, generator=torch.Generator().manual_seed(4))
    lora = model.clone()
    lora.add_patches({key: ("diff", (delta,))}, 1.0)
    baked = tiny_model("sd15")
    with torch.no_grad():
        baked.model.state_dict()[key].add_(delta)
    got = ksample(advanced(pack, lora, method="ToMe"), "sd15")
    assert torch.allclose(got, ksample(advanced(pack, baked, method="ToMe"), "sd15"), atol=1e-4)
    assert torch.equal(ksample(model, "sd15"), plain)  # ComfyUI takes the LoRA off when the plain clone loads


def test_attention_patches_and_replacements_still_run_under_the_node(pack):
    """IP-Adapter-style patches: an attn1 patch (on queries, keys and values), an attn2 output patch and an attn2
    replacement on every block, as ``set_model_attn1_patch``, ``set_model_attn2_output_patch`` and
    ``set_model_attn2_replace`` install them."""
    model = tiny_model("sd15")
    seen = {"output": 0, "replace": 0, "attn1": 0}

    def attn1_patch(q, k, v, extra_options):
        seen["attn1"] += 1
        return q, k * 0.98, v

    def output_patch(n, extra_options):
        seen["output"] += 1
        return n * 1.01

    def replacement(q, k, v, extra_options):
        seen["replace"] += 1
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return weights @ v

    patched = model.clone()
    patched.set_model_attn1_patch(attn1_patch)
    patched.set_model_attn2_output_patch(output_patch)
    for block in ("input", "output"):
        for index in ((1, 2) if block == "input" else (2, 3, 4, 5)):
            patched.set_model_attn2_replace(replacement, block, index)
    plain = ksample(patched, "sd15")
    without = dict(seen)
    seen.update(output=0, replace=0, attn1=0)
    merged = ksample(advanced(pack, patched, method="ToMe"), "sd15")
    assert seen == without and seen["replace"] > 0 and seen["output"] > 0 and seen["attn1"] > 0
    assert not torch.equal(merged, plain)
    assert torch.equal(ksample(patched, "sd15"), plain)


def test_an_attn1_replacement_leaves_its_blocks_unmerged_and_says_so(pack, caplog):
    """A node that replaces self-attention (``set_model_attn1_replace``) runs instead of the attention ToMe merges:
    those blocks compute exact attention, and one console line says how many calls did."""
    model = tiny_model("sd15")
    replaced = model.clone()
    calls = []

    def replacement(q, k, v, extra_options):
        calls.append(q.shape)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return weights @ v
    replaced.set_model_attn1_replace(replacement, "input", 1)
    with caplog.at_level(logging.INFO):
        ksample(advanced(pack, replaced, method="ToMe"), "sd15")
    assert calls and all(shape[-2] == 32 * 32 for shape in calls)  # whole, never merged tokens
    lines = [r.getMessage() for r in caplog.records if "ran without merging" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"[ToMe] {len(calls)} block calls ran without merging")


def test_a_two_pass_hires_workflow_patches_each_pass_for_itself(pack):
    model = tiny_model("sd15")
    merged_model = advanced(pack, model, method="ToMe")
    log = CallLog(pack, merged_model)
    first = ksample(merged_model, "sd15", steps=4)
    upscaled = nodes.LatentUpscale().upscale({"samples": first}, "nearest-exact", 384, 384, "disabled")[0]
    second = ksample(merged_model, "sd15", steps=6, denoise=0.5, samples=upscaled["samples"])
    log.remove()
    assert second.shape[-1] == 48
    grids = [call for call in log.calls if call is not None]
    assert len(grids) == len(log.calls)
    assert not is_patched(pack, model)


def test_an_sdxl_refiner_without_the_node_runs_plain(pack):
    base, refiner = tiny_model("sdxl", seed=0), tiny_model("sdxl", seed=1)
    start = ksample(advanced(pack, base, method="Cache"), "sdxl", steps=8)
    plain_refined = ksample(refiner, "sdxl", steps=4, denoise=0.3, samples=start)
    log = CallLog(pack, refiner)
    refined = ksample(refiner, "sdxl", steps=4, denoise=0.3, samples=start)
    log.remove()
    assert torch.equal(refined, plain_refined) and all(call is None for call in log.calls)


def test_controlnet_residuals_reach_every_step_of_a_cache_run(pack):
    """ControlNet adds its residuals to the U-Net's blocks outside the transformers, on every step: a run with a
    control gives other pixels than the same run without it, on the reused steps too."""
    import comfy.controlnet

    class Residuals(comfy.controlnet.ControlBase):
        """A control whose residuals are fixed tensors of the U-Net's block sizes (a ControlNet's output)."""

        def __init__(self, sizes):
            super().__init__()
            self.sizes = sizes

        def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
            gen = torch.Generator().manual_seed(9)
            return {"output": [0.3 * torch.randn((x_noisy.shape[0], *s), generator=gen) for s in self.sizes]}

        def copy(self):
            return Residuals(self.sizes)

    model = tiny_model("sdxl")
    sizes = [(64, 8, 8), (64, 8, 8), (64, 16, 16), (64, 16, 16), (32, 32, 32), (32, 32, 32)]
    positive = conditioning("sdxl", 10)
    controlled = [[positive[0][0], {**positive[0][1], "control": Residuals(sizes)}]]
    merged_model = advanced(pack, model, method="Cache")
    with_control = ksample(merged_model, "sdxl", positive=controlled, steps=8)
    without = ksample(merged_model, "sdxl", steps=8)
    assert not torch.allclose(with_control, without, atol=1e-3)
    assert not is_patched(pack, model)


# -- bad input --------------------------------------------------------------------------------------------------

def test_settings_that_cannot_apply_pass_the_model_through_with_one_line(pack, caplog):
    sdxl = tiny_model("sdxl")
    with caplog.at_level(logging.WARNING):
        out = advanced(pack, sdxl, method="ToMe", max_downsample="1")  # SDXL has no attention at level 0
    assert out is sdxl
    assert [r.getMessage() for r in caplog.records if "[ToMe]" in r.getMessage()] == [
        "[ToMe] the model is passed through unmerged: Merge levels 1 select none of its attention levels "
        "(max downsample 2, 4)"]

    class NotAUnet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    dit = tiny_model("sd15")
    dit.model.diffusion_model = NotAUnet()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert advanced(pack, dit, method="ToMe") is dit
    assert any("has no transformer blocks" in r.getMessage() for r in caplog.records)


def test_a_window_that_ends_before_it_starts_is_an_error_comfyui_shows(pack):
    with pytest.raises(ValueError, match="step_start must not exceed step_end"):
        advanced(pack, tiny_model("sd15"), step_start=0.8, step_end=0.2)


def test_recommended_is_todo_for_sd15_and_cache_for_sdxl(pack):
    simple = nodes.NODE_CLASS_MAPPINGS["TokenMerging"]
    for layout, method in (("sd15", "ToDo"), ("sdxl", "Cache")):
        model = tiny_model(layout)
        recommended = ksample(simple().patch(model, "Recommended", 0.5)[0], layout)
        assert torch.equal(recommended, ksample(advanced(pack, model, method=method), layout))


def test_the_pack_describes_itself_as_comfyui_and_its_manager_read_it(pack):
    """ComfyUI reads pyproject.toml's [tool.comfy] when it loads the clone; ComfyUI-Manager lists a pack's nodes
    from node_list.json where it cannot import them."""
    import json
    import os

    from comfy_config import config_parser

    from conftest import ROOT
    config = config_parser.extract_node_configuration(ROOT)
    assert config is not None and config.tool_comfy.display_name.startswith("Token Merging")
    with open(os.path.join(ROOT, "node_list.json"), encoding="utf-8") as file:
        listed = json.load(file)
    assert set(listed) == set(pack.NODE_CLASS_MAPPINGS) == set(nodes.NODE_DISPLAY_NAME_MAPPINGS) & set(listed)
