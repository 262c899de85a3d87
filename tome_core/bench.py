"""What token merging gains on this machine: ``python -m tome_core.bench --help``.

Builds the ldm U-Net architectures the webui runs (random weights; or a real checkpoint's U-Net with
``--checkpoint``), swaps ldm's attention for PyTorch's scaled-dot-product attention as the webui's
``--opt-sdp-attention`` does, and times, side by side in one process: no ToMe, ours, and tomesd (when
installed) with the same options. Prints markdown tables; nothing here is asserted by tests.

This module may import ``ldm`` (and ``tomesd``) when it runs; the rest of ``tome_core`` never does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import tome_core
from tome_core.partition import fixed_partition

# Architectures (ldm UNetModel arguments). SDXL's per-level depths (2 at downsample 2, 10 at 4) are made by
# building depth 10 and trimming the shallower level; its pooled-text embedding is left out.
ARCHS = {
    "sd15": dict(model_channels=320, channel_mult=[1, 2, 4, 4], attention_resolutions=[4, 2, 1], num_heads=8,
                 context_dim=768, use_linear_in_transformer=False, depths={0: 1, 1: 1, 2: 1, 3: 1}),
    "sd2": dict(model_channels=320, channel_mult=[1, 2, 4, 4], attention_resolutions=[4, 2, 1],
                num_head_channels=64, context_dim=1024, use_linear_in_transformer=True,
                depths={0: 1, 1: 1, 2: 1, 3: 1}),
    "sdxl": dict(model_channels=320, channel_mult=[1, 2, 4], attention_resolutions=[4, 2], num_head_channels=64,
                 context_dim=2048, use_linear_in_transformer=True, depths={1: 2, 2: 10}),
}


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled, self.t0 = max(total, 1), 0, enabled, time.time()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"{time.time() - self.t0:5.0f}s {label[:48]:<48}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def sdp_attention_forward(self, x, context=None, mask=None, **kwargs):
    """ldm CrossAttention with PyTorch SDP attention (what the webui's --opt-sdp-attention installs)."""
    h = self.heads
    context = x if context is None else context
    q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
    b, n, inner = q.shape
    q, k, v = (t.reshape(b, t.shape[1], h, inner // h).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return self.to_out(out.transpose(1, 2).reshape(b, n, inner))


def require_ldm() -> None:
    """Make ``ldm`` importable: installed, or the webui's own copy when this extension sits in a webui's
    ``extensions/`` folder (the webui adds it to the path only while it runs)."""
    try:
        import ldm.modules.diffusionmodules.openaimodel  # noqa: F401
        return
    except ImportError:
        pass
    extension = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # <webui>/extensions/<this extension>: from this file, or from the folder it is run in (PWD keeps the
    # path as typed when the extension folder is a link).
    starts = (extension, os.getcwd(), os.environ.get("PWD", os.getcwd()))
    for webui in [os.path.join(start, "..", "..") for start in starts]:
        candidate = os.path.normpath(os.path.join(webui, "repositories", "stable-diffusion-stability-ai"))
        if os.path.isdir(os.path.join(candidate, "ldm")) and candidate not in sys.path:
            sys.path.insert(0, candidate)
    try:
        import ldm.modules.diffusionmodules.openaimodel  # noqa: F401,F811
    except ImportError as error:
        raise SystemExit(f"the benchmark needs the ldm U-Net classes ({error}). Run it with the webui's Python "
                         f"from this extension's folder inside the webui, or install them: pip install "
                         f"--no-deps stable-diffusion-sdkit==2.1.5 einops omegaconf") from None


def use_sdp_attention() -> None:
    require_ldm()
    from ldm.modules.attention import CrossAttention

    CrossAttention.forward = sdp_attention_forward


def build_unet(arch: str, device: torch.device, dtype: torch.dtype, width: float = 1.0):
    """A random-weight ldm U-Net of ``arch`` (channels scaled by ``width``), on device, in eval mode."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    cfg = dict(ARCHS[arch])
    depths = cfg.pop("depths")
    cfg["model_channels"] = max(32, int(cfg["model_channels"] * width) // 32 * 32)  # GroupNorm needs 32·k
    if "num_head_channels" in cfg:
        cfg["num_head_channels"] = min(cfg["num_head_channels"], cfg["model_channels"])
    depth = max(depths.values())
    context_dim = cfg.pop("context_dim")
    torch.manual_seed(0)
    with torch.device(device):  # initialising SDXL's 2.6 B parameters on the host alone takes most of a minute
        unet = UNetModel(image_size=32, in_channels=4, out_channels=4, num_res_blocks=2, use_spatial_transformer=True,
                         transformer_depth=depth, context_dim=[context_dim] * depth, legacy=False, **cfg)
    trim_depths(unet, depths)
    with torch.no_grad():  # ldm zero-initialises these: random values make every block count
        for name, p in unet.named_parameters():
            if ".proj_out." in name or name.startswith("out."):
                p.normal_(0, 0.02)
    return in_run_dtype(unet, device, dtype), context_dim


def in_run_dtype(unet, device: torch.device, dtype: torch.dtype):
    """Move an ldm U-Net to ``device`` and ``dtype`` for inference, with ldm's float32 corners made consistent.

    ldm casts the latent to ``unet.dtype`` (float32 unless built with ``use_fp16``), feeds ``time_embed`` a
    float32 timestep embedding and computes GroupNorm32 in float32 from float32 parameters; the webui covers
    these with autocast on CUDA. Setting them explicitly runs the same way on every device.
    """
    unet = unet.to(device=device, dtype=dtype).eval()
    if dtype != torch.float32:
        unet.dtype = dtype
        unet.time_embed.register_forward_pre_hook(lambda module, args: (args[0].to(dtype),))
        for module in unet.modules():
            if type(module).__name__ == "GroupNorm32":
                module.float()
    return unet


def trim_depths(unet, depths: dict) -> None:
    from tome_core.patch import transformer_levels

    for _, transformer, level in transformer_levels(unet):
        keep = depths.get(level, len(transformer.transformer_blocks))
        transformer.transformer_blocks = transformer.transformer_blocks[:keep]


def timed(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()``."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        elif device.type == "mps":
            torch.mps.synchronize()
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def tomesd_available() -> bool:
    try:
        import tomesd  # noqa: F401
        return True
    except ImportError:
        return False


class _Wrapped(torch.nn.Module):
    """tomesd wants ``model.model.diffusion_model``."""

    def __init__(self, unet):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.diffusion_model = unet


def _contenders(ratio: float, use_rand: bool, ours_max_downsample: int | None, tomesd_max_downsample: int,
                tomesd_setup=lambda: None):
    """(name, apply(wrapped), remove(wrapped)) for no ToMe, ours and, when installed, tomesd."""
    out = [("none", lambda m: None, lambda m: None),
           ("ours", lambda m: tome_core.apply_patch(m, ratio=ratio, max_downsample=ours_max_downsample,
                                                   use_rand=use_rand), tome_core.remove_patch)]
    if tomesd_available():
        import tomesd

        def apply_tomesd(m):
            tomesd.apply_patch(m, ratio=ratio, max_downsample=tomesd_max_downsample, use_rand=use_rand)
            tomesd_setup()

        out.append(("tomesd", apply_tomesd, tomesd.remove_patch))
    return out


@dataclass
class Row:
    model: str
    size: int
    ratio: float
    none_ms: float
    ours_ms: float
    tomesd_ms: float | None

    def line(self) -> str:
        ts = f"{self.tomesd_ms:9.1f}" if self.tomesd_ms is not None else "        –"
        su_t = f"{self.none_ms / self.tomesd_ms:5.2f}x" if self.tomesd_ms else "    –"
        return (f"| {self.model:<6} | {self.size:>5} | {self.ratio:4.2f} | {self.none_ms:9.1f} | {self.ours_ms:9.1f} "
                f"| {ts} | {self.none_ms / self.ours_ms:5.2f}x | {su_t} |")


TABLE_HEAD = ("| model  |    px | ratio |  none ms |  ours ms | tomesd ms | ours speed-up | tomesd speed-up |\n"
              "|--------|------:|------:|---------:|---------:|----------:|------:|------:|")


def bench_unet(args, device, dtype, progress) -> list[Row]:
    rows = []
    for arch in args.models:
        unet, ctx_dim = build_unet(arch, device, dtype, args.width)
        depth = max(len(t.transformer_blocks) for _, t, _ in tome_core.patch.transformer_levels(unet))
        wrapped = _Wrapped(unet)
        for size in args.sizes:
            lat = size // 8
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(args.batch, 4, lat, lat, generator=gen).to(device, dtype)
            t = torch.full((args.batch,), 500.0, device=device)
            ctx = [torch.randn(args.batch, 77, ctx_dim, generator=gen).to(device, dtype)] * depth
            for ratio in args.ratios:
                md = args.max_downsample
                # On SDXL, give tomesd the level ours picks automatically, so the race is fair.
                tomesd_md = md or (2 if arch == "sdxl" else 1)
                ms = {}
                for name, apply, remove in _contenders(ratio, not args.no_rand, md, tomesd_md):
                    if name == "tomesd" and args.no_tomesd:
                        continue
                    apply(wrapped)
                    try:
                        ms[name] = timed(lambda: unet(x, t, context=ctx), device, args.repeats)
                    finally:
                        remove(wrapped)
                    progress.step(f"U-Net {arch} {size}px r={ratio} {name}")
                rows.append(Row(arch, size, ratio, ms["none"], ms["ours"], ms.get("tomesd")))
        del unet, wrapped
        gc.collect()
    return rows


def top_block(arch: str, device, dtype, width: float):
    """The first transformer of the highest-resolution attention level, alone, and its grid factor."""
    unet, ctx_dim = build_unet(arch, device, dtype, width)
    levels = tome_core.patch.transformer_levels(unet)
    top = min(level for _, _, level in levels)
    name, transformer, level = next(item for item in levels if item[2] == top)
    return transformer, ctx_dim, 2 ** level


def bench_block(args, device, dtype, progress) -> list[Row]:
    rows = []
    for arch in args.models:
        transformer, ctx_dim, down = top_block(arch, device, dtype, args.width)
        depth = len(transformer.transformer_blocks)
        wrapped = _Wrapped(transformer)
        channels = transformer.proj_in.in_channels if hasattr(transformer.proj_in, "in_channels") \
            else transformer.proj_in.in_features
        for size in args.sizes:
            grid = size // 8 // down
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(args.batch, channels, grid, grid, generator=gen).to(device, dtype)
            ctx = [torch.randn(args.batch, 77, ctx_dim, generator=gen).to(device, dtype)] * depth
            for ratio in args.ratios:
                ms = {}
                def tell_tomesd_the_grid(grid=grid):
                    # tomesd learns the latent size from a U-Net pre-hook, which a lone block does not have.
                    transformer._tome_info["size"] = (grid, grid)

                for name, apply, remove in _contenders(ratio, not args.no_rand, None, 8, tell_tomesd_the_grid):
                    if name == "tomesd" and args.no_tomesd:
                        continue
                    apply(wrapped)
                    try:
                        ms[name] = timed(lambda: transformer(x, context=ctx), device, args.repeats)
                    finally:
                        remove(wrapped)
                    progress.step(f"block {arch} {size}px r={ratio} {name}")
                rows.append(Row(arch, size, ratio, ms["none"], ms["ours"], ms.get("tomesd")))
    return rows


def merge_overhead(device, dtype, repeats: int, tokens_side: int = 64, channels: int = 320, ratio: float = 0.5,
                   batch: int = 2):
    """Milliseconds of finding the merge, merging and unmerging one (B, N, C) tensor: ours vs tomesd."""
    h = w = tokens_side
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, h * w, channels, generator=gen).to(device, dtype)
    r = int(h * w * ratio)
    out = {}

    def ours():
        src, dst = fixed_partition(h, w, 2, 2, x.device, torch.int64)
        plan = tome_core.plan_merge(x, src, dst, r)
        return plan.unmerge(plan.merge(x))

    out["ours"] = timed(ours, device, repeats)
    if tomesd_available():
        import tomesd.merge

        def theirs():
            m, u = tomesd.merge.bipartite_soft_matching_random2d(x, w, h, 2, 2, r, no_rand=True)
            return u(m(x))

        out["tomesd"] = timed(theirs, device, repeats)
        torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-4)
    return out


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Current resident bytes, after resetting the kernel's peak counter (Linux) so that import-time peaks
    do not hide what the measured code needs."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (_status_kb("VmRSS") or 0) * 1024


def _peak_rss() -> int:
    hwm = _status_kb("VmHWM")
    return hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_memory_child(which: str, side: int, channels: int, batch: int, dtype: str, device: str) -> None:
    """Run one find+merge+unmerge and print the peak memory it needed above its inputs (bytes)."""
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    x = torch.randn(batch, side * side, channels, device=dev, dtype=dt)
    r = side * side // 2
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        start = _reset_peak_rss()
    with torch.no_grad():
        if which == "ours":
            src, dst = fixed_partition(side, side, 2, 2, dev, torch.int64)
            plan = tome_core.plan_merge(x, src, dst, r)
            y = plan.unmerge(plan.merge(x))
        else:
            import tomesd.merge

            m, u = tomesd.merge.bipartite_soft_matching_random2d(x, side, side, 2, 2, r, no_rand=True)
            y = u(m(x))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        peak = _peak_rss() - start
    del y
    print(json.dumps({"peak": peak}))


def peak_memory(which: str, size_px: int, channels: int, batch: int, dtype: torch.dtype, device: torch.device):
    side = size_px // 8
    cmd = [sys.executable, "-m", "tome_core.bench", "--_peak-child", which, str(side), str(channels), str(batch),
           str(dtype).replace("torch.", ""), str(device)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tome_core.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, mps (default: cuda or mps when found, else cpu)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="default: float16 on cuda/mps, float32 on cpu")
    ap.add_argument("--models", nargs="+", default=["sd15"], choices=sorted(ARCHS))
    ap.add_argument("--sizes", nargs="+", type=int, default=None,
                    help="image sizes in px (default: 512 768 1024 on a GPU, 512 768 on the CPU)")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.5])
    ap.add_argument("--batch", type=int, default=2, help="U-Net batch (2 = one image with cond and uncond)")
    ap.add_argument("--max-downsample", type=int, default=None, choices=[1, 2, 4, 8],
                    help="default: the model's highest-resolution attention level")
    ap.add_argument("--no-rand", action="store_true", help="fixed partition (use_rand=False)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=float, default=1.0, help="scale the channel count (for quick runs)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["unet", "block", "overhead", "memory"])
    ap.add_argument("--memory-size", type=int, default=2048, help="px for the peak-memory probe of one top block")
    ap.add_argument("--no-tomesd", action="store_true", help="leave tomesd out even when installed")
    ap.add_argument("--plot", default=None, help="write a PNG chart of the U-Net speed-ups here")
    ap.add_argument("--checkpoint", default=None,
                    help="a .safetensors/.ckpt SD 1.x/2.x/SDXL checkpoint: time its U-Net and report how far "
                         "ToMe moves its prediction (relative L2) per ratio")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--_peak-child", nargs=6, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{device.type}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._peak_child:
        which, side, channels, batch, dtype, device = args._peak_child
        _peak_memory_child(which, int(side), int(channels), int(batch), dtype, device)
        return 0
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.float16)
    if args.sizes is None:
        args.sizes = [512, 768] if device.type == "cpu" else [512, 768, 1024]
    use_sdp_attention()
    print(f"# ToMe benchmark: {hardware(device)}, {str(dtype).replace('torch.', '')}, batch {args.batch}, "
          f"SDP attention, use_rand={not args.no_rand}, max_downsample="
          f"{args.max_downsample or 'auto'}, tomesd {'yes' if tomesd_available() and not args.no_tomesd else 'no'}")
    print(f"# command: python -m tome_core.bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.checkpoint:
        from tome_core.checkpoint import checkpoint_report

        checkpoint_report(args, device, dtype)
        return 0
    contenders = 3 if tomesd_available() and not args.no_tomesd else 2
    runs = len(args.models) * len(args.sizes) * len(args.ratios) * contenders
    progress = Progress(runs * (("unet" not in args.skip) + ("block" not in args.skip)), not args.quiet)
    unet_rows = block_rows = []
    if "block" not in args.skip:
        block_rows = bench_block(args, device, dtype, progress)
    if "unet" not in args.skip:
        unet_rows = bench_unet(args, device, dtype, progress)
    progress.close()
    if block_rows:
        print("\n## One highest-resolution transformer (ms per call)\n")
        print(TABLE_HEAD)
        for row in block_rows:
            print(row.line())
    if unet_rows:
        print("\n## Whole U-Net step (ms per call)\n")
        print(TABLE_HEAD)
        for row in unet_rows:
            print(row.line())
    if "overhead" not in args.skip:
        ov = merge_overhead(device, dtype, max(args.repeats, 5))
        print("\n## Merge overhead: find + merge + unmerge of (2, 4096, 320), ratio 0.5 (ms)\n")
        print("| ours | tomesd | ours / tomesd |\n|-----:|-------:|------:|")
        t = ov.get("tomesd")
        print(f"| {ov['ours']:.1f} | {t:.1f} | {ov['ours'] / t:.2f} |" if t else f"| {ov['ours']:.1f} | – | – |")
    if "memory" not in args.skip and args.memory_size:
        print(f"\n## Peak extra memory of find + merge + unmerge, one top block at {args.memory_size} px "
              f"(2, {(args.memory_size // 8) ** 2}, 320)\n")
        print("| ours MB | tomesd MB |\n|--------:|----------:|")
        ours = peak_memory("ours", args.memory_size, 320, 2, dtype, device)
        theirs = peak_memory("tomesd", args.memory_size, 320, 2, dtype, device) if tomesd_available() else None
        fmt = lambda v: f"{v / 2 ** 20:,.0f}" if v is not None else "–"  # noqa: E731
        print(f"| {fmt(ours)} | {fmt(theirs)} |")
    if args.plot and unet_rows:
        write_plot(unet_rows, args.plot, hardware(device))
        print(f"\nplot written to {args.plot}")
    return 0


def write_plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r.model}\n{r.size}px r={r.ratio}" for r in rows]
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r.none_ms / r.ours_ms for r in rows], 0.4, label="ours")
    if any(r.tomesd_ms for r in rows):
        ax.bar([i + 0.2 for i in xs], [r.none_ms / r.tomesd_ms if r.tomesd_ms else 0 for r in rows], 0.4,
               label="tomesd")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("U-Net speed-up over no ToMe")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
