"""Load the U-Net of a real SD 1.x / 2.x / SDXL checkpoint and measure what ToMe does to it.

The architecture is read from the checkpoint's own tensors (channel widths, levels with attention, depth
per level, context width, linear or conv projections), so fine-tunes and small test checkpoints load too.
Used by ``python -m tome_core.bench --checkpoint FILE``; imports ``ldm`` when it runs.
"""

from __future__ import annotations

import re

import torch

import tome_core

PREFIX = "model.diffusion_model."


def load_state_dict(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    data = torch.load(path, map_location="cpu", weights_only=True)
    return data.get("state_dict", data)


def unet_config(sd: dict) -> dict:
    """ldm UNetModel arguments (plus ``family`` and per-level ``depths``) read off a U-Net state dict whose
    keys start with ``model.diffusion_model.``."""
    w = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
    if "input_blocks.0.0.weight" not in w:
        raise ValueError("no U-Net in this checkpoint (no 'model.diffusion_model.input_blocks.0.0.weight'); "
                         "SD3, Flux and other transformer-only models are not supported")
    model_channels, in_channels = w["input_blocks.0.0.weight"].shape[:2]
    n_inputs = 1 + max(int(m.group(1)) for k in w if (m := re.match(r"input_blocks\.(\d+)\.", k)))
    level, levels, res_per_level, depths, attention_levels = 0, [], {}, {}, set()
    for i in range(1, n_inputs):
        if f"input_blocks.{i}.0.op.weight" in w:  # a Downsample block
            level += 1
            continue
        levels.append(level)
        res_per_level[level] = res_per_level.get(level, 0) + 1
        out_ch = w[f"input_blocks.{i}.0.out_layers.3.weight"].shape[0]
        res_per_level.setdefault(("ch", level), out_ch)
        blocks = {int(m.group(1)) for k in w
                  if (m := re.match(rf"input_blocks\.{i}\.1\.transformer_blocks\.(\d+)\.", k))}
        if blocks:
            attention_levels.add(level)
            depths[level] = max(depths.get(level, 0), len(blocks))
    num_levels = level + 1
    middle = {int(m.group(1)) for k in w if (m := re.match(r"middle_block\.1\.transformer_blocks\.(\d+)\.", k))}
    depths[num_levels - 1] = max(depths.get(num_levels - 1, 0), len(middle))
    to_k = next(v for k, v in w.items() if k.endswith("attn2.to_k.weight"))
    proj_in = next(v for k, v in w.items() if k.endswith(".proj_in.weight"))
    use_linear = proj_in.dim() == 2
    family = "sdxl" if "label_emb.0.0.weight" in w else ("sd2" if use_linear else "sd1")
    cfg = dict(in_channels=int(in_channels), out_channels=int(w["out.2.weight"].shape[0]),
               model_channels=int(model_channels), num_res_blocks=res_per_level[0],
               channel_mult=[res_per_level[("ch", lv)] // model_channels for lv in range(num_levels)],
               attention_resolutions=sorted(2 ** lv for lv in attention_levels),
               context_dim=int(to_k.shape[1]), use_linear_in_transformer=use_linear)
    if family == "sd1":
        cfg["num_heads"] = 8
    else:
        cfg["num_head_channels"] = min(64, int(model_channels))
    return dict(cfg, family=family, depths=depths)


def build_from_checkpoint(path: str, device: torch.device, dtype: torch.dtype):
    """(U-Net, family, context_dim) with the checkpoint's weights loaded."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    from .bench import in_run_dtype, trim_depths

    sd = load_state_dict(path)
    cfg = unet_config(sd)
    family, depths = cfg.pop("family"), cfg.pop("depths")
    depth = max(depths.values())
    context_dim = cfg.pop("context_dim")
    unet = UNetModel(image_size=32, use_spatial_transformer=True, transformer_depth=depth,
                     context_dim=[context_dim] * depth, legacy=False, **cfg)
    trim_depths(unet, depths)
    weights = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
    # SDXL's pooled-text embedding (label_emb) has no place in this conditioning-free probe.
    weights = {k: v for k, v in weights.items() if not k.startswith("label_emb.")}
    missing, unexpected = unet.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the inferred {family} U-Net: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return in_run_dtype(unet, device, dtype), family, context_dim


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def checkpoint_report(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Print, per ratio, ms per U-Net call and the relative L2 distance of the patched prediction from the
    unpatched one on fixed noise at a few timesteps. Returns the rows."""
    from .bench import Progress, timed

    unet, family, context_dim = build_from_checkpoint(args.checkpoint, device, dtype)
    depth = max(len(t.transformer_blocks) for _, t, _ in tome_core.patch.transformer_levels(unet))
    size = args.sizes[0]
    lat = size // 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, unet.in_channels, lat, lat, generator=gen).to(device, dtype)
    ctx = [torch.randn(args.batch, 77, context_dim, generator=gen).to(device, dtype)] * depth
    timesteps = (999.0, 749.0, 499.0, 249.0)
    progress = Progress(len(args.ratios) + 1, not args.quiet)
    with torch.no_grad():
        reference = {t: unet(x, torch.full((args.batch,), t, device=device), context=ctx) for t in timesteps}
        base_ms = timed(lambda: unet(x, torch.full((args.batch,), 500.0, device=device), context=ctx), device,
                        args.repeats)
        progress.step("no ToMe")
        rows = []
        for ratio in args.ratios:
            tome_core.apply_patch(unet, ratio=ratio, max_downsample=args.max_downsample, use_rand=not args.no_rand)
            try:
                errors = [relative_l2(unet(x, torch.full((args.batch,), t, device=device), context=ctx),
                                      reference[t]) for t in timesteps]
                ms = timed(lambda: unet(x, torch.full((args.batch,), 500.0, device=device), context=ctx), device,
                           args.repeats)
            finally:
                tome_core.remove_patch(unet)
            rows.append(dict(ratio=ratio, ms=ms, speedup=base_ms / ms, errors=errors))
            progress.step(f"ratio {ratio}")
    progress.close()
    print(f"\n## {args.checkpoint}: {family} U-Net at {size} px, batch {args.batch}\n")
    print("| ratio | ms | speed-up | " + " | ".join(f"rel. L2 t={int(t)}" for t in timesteps) + " |")
    print("|------:|---:|------:|" + "------:|" * len(timesteps))
    print(f"| 0 | {base_ms:.1f} | 1.00x | " + " | ".join("0" for _ in timesteps) + " |")
    for row in rows:
        print(f"| {row['ratio']:.2f} | {row['ms']:.1f} | {row['speedup']:.2f}x | "
              + " | ".join(f"{e:.4f}" for e in row["errors"]) + " |")
    return rows
