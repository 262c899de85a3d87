"""The benchmark runs end to end (quick settings) and loads a real checkpoint's U-Net."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import tome_core
from tome_core.bench import archs, cli, timing
from tome_core.bench.checkpoint import build_from_checkpoint, unet_config
from unets import LAYOUTS, inputs, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def webui_unet_for_this_test_only(monkeypatch):
    """The benchmark patches ldm process-wide as the webui does (SDP attention, since ldm's own fails in
    float16; a resizing torch.cat); give every test here those patches and take them back afterwards, so other
    test files see ldm as it is."""
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)
    archs.use_webui_unet()


def test_bench_prints_tables(capsys, tmp_path):
    plot = tmp_path / "speedup.png"
    rc = cli.main(["--sizes", "128", "--width", "0.1", "--repeats", "1", "--memory-size", "128", "--quiet",
                   "--models", "sd15", "sdxl", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "## Whole U-Net step" in out and "## One highest-resolution transformer" in out
    for model in ("sd15", "sdxl"):
        for method in ("none | –", "ToMe | 0.50", "ToDo | f=2", "tomesd | 0.50", "ideal | 0.50"):
            assert out.count(f"| {model} | 128 | {method} |") == 2, (model, method)
    assert out.count("Random weights: no fidelity figure") == 2
    assert "## Merge overhead" in out and "## Peak extra memory" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_sdxl_layout_has_its_level_depths():
    unet, _ = archs.build_unet("sdxl", torch.device("cpu"), torch.float32, width=0.05)
    depths = {}
    for name, t, level in __import__("tome_core").patch.transformer_levels(unet):
        depths.setdefault(level, set()).add(len(t.transformer_blocks))
    assert depths == {1: {2}, 2: {10}}


def _float32_and_half_twins(arch, dtype, latent):
    """The same random U-Net in float32 and in ``dtype``, with inputs in each one's dtype."""
    cpu = torch.device("cpu")
    full, ctx_dim = archs.build_unet(arch, cpu, torch.float32, width=0.1)
    half, _ = archs.build_unet(arch, cpu, dtype, width=0.1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, latent, latent, generator=gen)
    ctx = [torch.randn(2, 77, ctx_dim, generator=gen)] * 10
    t = torch.tensor([749.0, 749.0])
    return (full, (x, t), dict(context=ctx)), (half, (x.to(dtype), t), dict(context=[c.to(dtype) for c in ctx]))


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_u_net_follows_its_float32_twin(arch, dtype, tolerance):
    # The GPU runs are half precision: the same weights must predict what float32 predicts, up to rounding.
    (full, args, kwargs), (half, half_args, half_kwargs) = _float32_and_half_twins(arch, dtype, 16)
    with torch.no_grad():
        expected = full(*args, **kwargs)
        got = half(*half_args, **half_kwargs)
    assert got.dtype == dtype
    assert ((got.float() - expected).norm() / expected.norm()).item() < tolerance


def test_half_precision_merge_follows_the_float32_merge():
    # ToMe in float16 must land where ToMe in float32 lands, up to rounding: much closer to it than the
    # merge itself moves the prediction (a wrong half-precision merge would be off by about the merge effect).
    import tome_core

    (full, args, kwargs), (half, half_args, half_kwargs) = _float32_and_half_twins("sd15", torch.float16, 32)
    with torch.no_grad():
        unmerged = full(*args, **kwargs)
        for unet in (full, half):
            tome_core.apply_patch(unet, ratio=0.5, seed=3)
        merged = full(*args, **kwargs)
        merged_half = half(*half_args, **half_kwargs).float()
    effect = (merged - unmerged).norm()
    assert effect > 0
    assert (merged_half - merged).norm() < effect / 3


@pytest.mark.parametrize("layout", ["sd1", "sd2", "sdxl"])
def test_checkpoint_u_net_is_read_from_its_tensors(tmp_path, layout):
    from safetensors.torch import save_file

    # Heads cannot be read off weights: SD 1.x has 8, SD 2.x/SDXL 64-channel heads (capped at the width).
    unet = tiny_unet(layout, **({"num_heads": 8} if layout == "sd1" else {"num_head_channels": 32}))
    sd = {"model.diffusion_model." + k: v.contiguous() for k, v in unet.state_dict().items()}
    sd["first_stage_model.decoder.conv_in.weight"] = torch.zeros(3)  # other parts of a checkpoint are ignored
    path = tmp_path / "tiny.safetensors"
    save_file(sd, str(path))
    cfg = unet_config(sd)
    assert cfg["family"] == ("sd1" if layout == "sd1" else "sd2")  # no label_emb: not SDXL
    assert cfg["attention_resolutions"] == sorted(LAYOUTS[layout]["attention_resolutions"])
    assert cfg["channel_mult"] == LAYOUTS[layout]["channel_mult"]
    loaded, family, context_dim = build_from_checkpoint(str(path), torch.device("cpu"), torch.float32)
    x, t, c = inputs()
    with torch.no_grad():
        assert torch.equal(loaded(x, t, context=[c]), unet(x, t, context=c))


def test_checkpoint_fidelity_from_the_command_line(tmp_path, monkeypatch, capsys):
    # The checkpoint's loading is checkpoint.load_pipeline's own (tested with it); here a stand-in builds the
    # Pipeline from the U-Net alone, and the command line must sample, compare and time it.
    from safetensors.torch import save_file

    from tome_core.bench import checkpoint
    from tome_core.bench.pipeline import Pipeline

    unet = tiny_unet("sd1")
    path = tmp_path / "tiny.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in unet.state_dict().items()}, str(path))

    def load_pipeline(file, device, dtype, prediction="auto"):
        loaded, family, context_dim = build_from_checkpoint(file, device, dtype)
        return Pipeline(family, loaded, torch.zeros(1, 77, context_dim), notes=["no VAE: latents compared"])

    monkeypatch.setattr(checkpoint, "load_pipeline", load_pipeline, raising=False)
    assert cli.main(["--checkpoint", str(path), "--sizes", "128", "--ratios", "0.3", "0.6", "--todo-factors", "2",
                     "--steps", "2", "--repeats", "1", "--quiet", "--no-tomesd", "--sheet",
                     str(tmp_path / "sheet.png")]) == 0
    out = capsys.readouterr().out
    assert "# note: no VAE: latents compared" in out and "the sampled tensors (no decoder)" in out
    psnr = {line.split("|")[3].strip() + " " + line.split("|")[4].strip(): line.split("|")[8].strip()
            for line in out.splitlines() if line.startswith("| sd1 | 128 |")}
    assert psnr["none –"] == "∞"
    assert all(float(psnr[k]) > 0 for k in ("ToMe 0.30", "ToMe 0.60", "ToDo f=2"))
    assert float(psnr["ToMe 0.60"]) < float(psnr["ToMe 0.30"])  # merging more moves the picture further
    assert (tmp_path / "sheet.png").stat().st_size > 1000


def test_checkpoint_without_unet_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no U-Net"):
        unet_config({"model.diffusion_model.joint_blocks.0.x": torch.zeros(1)})


def test_gpu_check_script_runs_small_on_cpu(capsys):
    from tome_core.bench import gpucheck

    # --steps 0: the fidelity section on the proxy has its own test (test_bench_fidelity), on a stand-in.
    assert gpucheck.main(["--device", "cpu", "--width", "0.1", "--scale", "0.125", "--repeats", "2",
                          "--steps", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert [line.split("|")[1:3] for line in out.splitlines() if line.startswith(("| sd15 |", "| sdxl |"))
            and "| none |" in line] == [[" sd15 ", " 64 "], [" sd15 ", " 128 "], [" sd15 ", " 256 "], [" sdxl ", " 128 "],
                                        [" sdxl ", " 256 "]]
    assert "| sdxl ×8 | 128 | none |" in out  # the larger batch, timed as well
    for method in ("ToMe | 0.50", "ToDo | f=2", "Local | 0.50", "Stack | 0.50", "tomesd | 0.50", "ideal | 0.50",
                   "ideal | S 0.50"):
        assert out.count(f"| {method} |") == 6, method
    assert "GPU busy" not in out  # measured on CUDA only
    assert "| ops/stack | MACs |" in out
    assert "| share |" in out and "| ops/block |" in out
    assert "merge plans (partition, matching, slot maps) identical" in out
    assert "bitwise equal" in out or "equal up to half-precision rounding" in out


def test_device_busy_time_is_a_cuda_measure_only():
    unet = tiny_unet("sd1")
    x, t, c = inputs()
    assert timing.device_busy_ms(lambda: unet(x, t, context=c), torch.device("cpu")) is None


def test_gpu_busy_table_measures_each_method_patched_and_restores_the_u_net(monkeypatch):
    # A stand-in for the profiler: the GPU's busy time is 20 ms unpatched and 10 ms with any patch on, so each
    # line shows whether its method was on while it was measured; the wall times are the race's medians.
    from tome_core.bench import gpucheck
    from tome_core.bench.contenders import Wrapped, roster
    from tome_core.bench.jobs import entries
    from tome_core.bench.report import Case
    from tome_core.bench.timing import Spread

    unet = tiny_unet("sd1")
    x, t, c = inputs()
    wrapped = Wrapped(unet)
    racers = [r for r in roster([0.5], [2], with_tomesd=False, with_ideal=False) if r.method in ("none", "ToMe")]
    case = Case("sd15", 64, entries(racers), {"none": Spread.of([40.0]), racers[1].name: Spread.of([20.0])})
    monkeypatch.setattr(gpucheck, "device_busy_ms",
                        lambda call, device: 10.0 if tome_core.patched_blocks(unet) else 20.0)
    lines = gpucheck.busy_table_lines(case, racers, wrapped, lambda: unet(x, t, context=c), torch.device("cpu"))
    assert lines == ["| sd15 | 64 | none | – | 40.0 | 20.0 | 50% |",
                     "| sd15 | 64 | ToMe | 0.50 | 20.0 | 10.0 | 50% |"]
    assert not tome_core.patched_blocks(unet)

    def broken(call, device):
        raise RuntimeError("no CUPTI")

    monkeypatch.setattr(gpucheck, "device_busy_ms", broken)
    lines = gpucheck.busy_table_lines(case, racers, wrapped, lambda: unet(x, t, context=c), torch.device("cpu"))
    assert lines == ["| sd15 | 64 | none | – | – | not measured: RuntimeError: no CUPTI | – |"]
    assert not tome_core.patched_blocks(unet)


def test_gpu_check_counts_syncs_the_patch_adds(monkeypatch):
    # CUDA's sync debug mode reports each synchronizing call as a warning. Stand in for it on the CPU: one
    # simulated sync in the U-Net's own code, then also one in every merge, to run the GPU-only path.
    from tome_core.bench import gpucheck
    from tome_core.merge import MergePlan

    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(now=m))

    def sync_here(*_):
        if mode["now"] == "warn":
            warnings.warn("called a synchronizing CUDA operation")

    unet = tiny_unet("sd1")
    unet.register_forward_pre_hook(sync_here)
    x, t, c = inputs()
    assert gpucheck.sync_check(unet, x, t, c) == "1 unpatched (ldm's own), 1 patched: none added by the patch"
    assert mode["now"] == 0  # the debug mode is switched off again

    # Expected merges per call: one per block at the highest resolution (default levels, self-attention only).
    tokens = []
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    handles = [b.register_forward_pre_hook(lambda m, a, k: tokens.append((a[0] if a else k["x"]).shape[1]),
                                           with_kwargs=True) for b in blocks]
    with torch.no_grad():
        unet(x, t, context=c)
    for h in handles:
        h.remove()
    merges = tokens.count(max(tokens))
    plain_merge = MergePlan.merge
    monkeypatch.setattr(MergePlan, "merge", lambda self, v: (sync_here(), plain_merge(self, v))[1])
    assert gpucheck.sync_check(unet, x, t, c) == (f"1 unpatched (ldm's own), {1 + merges} patched: "
                                                  f"{merges} added by the patch")
