"""The node's overhead: a whole sampling run through ComfyUI's own KSampler, with and without the node, beside the
same run through the engine alone (the same U-Net called in a plain loop, patched with ``tome_core``), on the real
SD 1.5 and SDXL U-Net layouts and widths (ComfyUI's own classes, random weights: speed does not depend on them).

Run it with ComfyUI's environment, on a quiet machine (it prints a table; nothing is asserted)::

    .comfyui/venv/bin/python tokenmerge_comfy/benchmark.py --comfyui .comfyui/ComfyUI [--layout sd15 --size 512]

Per layout it times, over the same steps and in interleaved rounds (the median shown): ComfyUI plain, ComfyUI
with the node (per method), the engine's loop plain and patched. The node's overhead per run is what ComfyUI adds over the engine's loop with the node, less
what it adds without it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The real U-Nets, as ComfyUI's model detection configures them (comfy/model_detection.py, v0.3.64).
LAYOUTS = {
    "sd15": dict(model="SD15", context=768, adm=None, unet=dict(
        model_channels=320, num_res_blocks=[2, 2, 2, 2], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
        channel_mult=[1, 2, 4, 4], transformer_depth_middle=1, use_linear_in_transformer=False, context_dim=768,
        num_heads=8, num_head_channels=-1, transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        adm_in_channels=None)),
    "sdxl": dict(model="SDXL", context=2048, adm=2816, unet=dict(
        model_channels=320, num_res_blocks=[2, 2, 2], transformer_depth=[0, 0, 2, 2, 10, 10],
        channel_mult=[1, 2, 4], transformer_depth_middle=10, use_linear_in_transformer=True, context_dim=2048,
        num_head_channels=64, transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], adm_in_channels=2816,
        num_classes="sequential")),
}


def build(layout: str):
    import torch

    import comfy.model_patcher
    import comfy.supported_models
    spec = LAYOUTS[layout]
    model_class = getattr(comfy.supported_models, spec["model"])
    config = dict(model_class.unet_config)
    config.update(spec["unet"], in_channels=4, out_channels=4, use_spatial_transformer=True, legacy=False,
                  use_checkpoint=False, image_size=32, use_temporal_resblock=False, use_temporal_attention=False)
    model_config = model_class(config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ComfyUI leaves its layers uninitialised: give every weight a finite random value
        for p in model.diffusion_model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel() if p.dim() > 1 else 1) * 0.5)
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def conditioning(layout: str):
    import torch
    gen = torch.Generator().manual_seed(1)
    extra = {"pooled_output": torch.randn(1, 1280, generator=gen)} if LAYOUTS[layout]["adm"] else {}
    return [[torch.randn(1, 77, LAYOUTS[layout]["context"], generator=gen), extra]]


def comfy_run(model, layout: str, size: int, steps: int) -> float:
    import torch

    import nodes
    latent = {"samples": torch.zeros(1, 4, size // 8, size // 8)}
    start = time.perf_counter()
    nodes.common_ksampler(model, 1, steps, 7.0, "euler", "normal", conditioning(layout), conditioning(layout),
                          latent)
    return time.perf_counter() - start


def engine_run(model, layout: str, size: int, steps: int, engine, options: dict | None) -> float:
    """The same U-Net evaluations as ComfyUI's run (cond and uncond in one batch of 2, at its sigmas), in a
    plain loop with nothing of ComfyUI's around them."""
    import torch
    unet = model.model.diffusion_model
    sampling = model.model.model_sampling
    sigmas = torch.linspace(float(sampling.sigma_max), float(sampling.sigma_min), steps)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, size // 8, size // 8, generator=gen)
    context = torch.cat([conditioning(layout)[0][0]] * 2)
    extra = {"y": torch.randn(2, LAYOUTS[layout]["adm"], generator=gen)} if LAYOUTS[layout]["adm"] else {}
    if options is not None:
        engine.apply_patch(unet, **options)
    start = time.perf_counter()
    with torch.no_grad():
        for i, sigma in enumerate(sigmas):
            if options is not None:
                engine.set_progress(unet, (i + 0.5) / steps)
            t = sampling.timestep(sigma).expand(2)
            out = unet(x, t, context=context, **extra)
            x = x - 0.05 * out
    elapsed = time.perf_counter() - start
    if options is not None:
        engine.remove_patch(unet)
    return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", required=True, help="the ComfyUI folder (its main.py)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: both")
    parser.add_argument("--size", type=int, action="append", help="image size in px per layout (default 512)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--methods", default="ToMe,Cache")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every run once (median shown)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.comfyui))
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import torch

    import nodes
    torch.set_grad_enabled(False)
    if "TokenMergingAdvanced" not in nodes.NODE_CLASS_MAPPINGS:
        asyncio.run(nodes.load_custom_node(ROOT))
    node = nodes.NODE_CLASS_MAPPINGS["TokenMergingAdvanced"]
    pack = sys.modules[node.__module__.rsplit(".", 2)[0]]
    engine = pack.tome_core
    defaults = {k: v[1]["default"] for k, v in node.INPUT_TYPES()["required"].items() if k != "model"}
    layouts = args.layout or ["sd15", "sdxl"]
    sizes = args.size or [512] * len(layouts)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} Euler steps, cfg 7 "
          f"(cond and uncond in one call), median of {args.rounds} interleaved rounds")
    print("| layout | size | method | ComfyUI plain s | ComfyUI node s | speed-up | engine plain s | engine patched s "
          "| speed-up | node overhead s |")
    print("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|")
    for layout, size in zip(layouts, sizes):
        model = build(layout)
        comfy_run(model, layout, 256, 2)  # a warm-up run: ComfyUI loads the model, the allocator settles
        methods = args.methods.split(",")
        merged = {m: node().patch(model, **{**defaults, "method": m})[0] for m in methods}
        options = {m: engine.settings.TokenMergeSettings(enabled=True, **{**defaults, "method": m})
                   .engine_options(hires=False, seed=1) for m in methods}
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine touches every run alike
            times.setdefault("comfy plain", []).append(comfy_run(model, layout, size, args.steps))
            times.setdefault("engine plain", []).append(engine_run(model, layout, size, args.steps, engine, None))
            for m in methods:
                times.setdefault(f"comfy {m}", []).append(comfy_run(merged[m], layout, size, args.steps))
                times.setdefault(f"engine {m}", []).append(
                    engine_run(model, layout, size, args.steps, engine, options[m]))
        median = {k: statistics.median(v) for k, v in times.items()}
        for m in methods:
            comfy_plain, comfy_node = median["comfy plain"], median[f"comfy {m}"]
            engine_plain, engine_patched = median["engine plain"], median[f"engine {m}"]
            overhead = (comfy_node - engine_patched) - (comfy_plain - engine_plain)
            print(f"| {layout} | {size} | {m} | {comfy_plain:.1f} | {comfy_node:.1f} | "
                  f"{comfy_plain / comfy_node:.2f}x | {engine_plain:.1f} | {engine_patched:.1f} | "
                  f"{engine_plain / engine_patched:.2f}x | {overhead:+.1f} |", flush=True)
        del model, merged

if __name__ == "__main__":
    main()
