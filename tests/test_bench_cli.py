"""The benchmark's command lines: every bad input is one line and exit status 2 before anything is timed; the
module entry points work; the measurement package stays apart from the engine."""

import os
import subprocess
import sys

import pytest
import torch

from tome_core.bench import archs, arguments, cli, gpucheck, jobs, runs

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(autouse=True)
def webui_unet_for_this_test_only(monkeypatch):
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)


@pytest.fixture
def nothing_is_timed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("timing started")

    monkeypatch.setattr(jobs, "model_timer", refuse)
    monkeypatch.setattr(runs, "merge_overhead", refuse)
    monkeypatch.setattr(archs, "build_unet", refuse)
    monkeypatch.setattr(jobs, "sample_pictures", refuse)


def _refused(capsys, main, argv, expected):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "error: " in err and expected in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, expected", [
    (["--ratios", "0.95"], "--ratios 0.95: a merge ratio must lie in [0, 0.9]"),
    (["--ratios", "0.5", "-0.1"], "--ratios -0.1: a merge ratio must lie in [0, 0.9]"),
    (["--ratios", "nan"], "--ratios nan: a merge ratio must lie in [0, 0.9]"),
    (["--repeats", "0"], "--repeats 0: at least 1 round is needed"),
    (["--models", "sd15", "--sizes", "512", "100"], "--sizes 100: image sizes must be positive multiples of 8 px"),
    (["--sizes", "0"], "--sizes 0: image sizes must be positive multiples of 8 px"),
    (["--sizes", "-512"], "--sizes -512: image sizes must be positive multiples of 8 px"),
    (["--models", "sd15", "--sizes", "8"], "--sizes 8: too small for sd15: its highest-resolution attention sees a 1×1 token grid"),
    (["--models", "sdxl", "--sizes", "16"], "too small for sdxl"),
    (["--models", "sdxl", "--max-downsample", "1"], "--max-downsample 1 selects no attention level of sdxl"),
    (["--width", "0"], "--width 0: a channel scale must be a positive number"),
    (["--models", "sd15", "--sizes", "16", "--batch", "1", "--width", "0.1"], "--sizes 16 with --batch 1 at --width 0.1"),
    (["--batch", "0"], "--batch 0: at least 1 is needed"),
    (["--threads", "0"], "--threads 0: at least 1 is needed"),
    (["--memory-size", "100"], "--memory-size 100"),
    (["--device", "tpu9"], "--device tpu9: not a device name torch knows"),
    (["--plot", "/no/such/folder/speedup.png"], "--plot /no/such/folder/speedup.png: no folder /no/such/folder"),
    (["--models", "sd3"], "argument --models: invalid choice: 'sd3'"),
    (["--repeats", "three"], "argument --repeats: invalid int value: 'three'"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, nothing_is_timed, argv, expected):
    _refused(capsys, cli.main, argv, expected)


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")
def test_cuda_without_cuda_is_refused(capsys, nothing_is_timed):
    _refused(capsys, cli.main, ["--device", "cuda"], "--device cuda: this torch")
    _refused(capsys, gpucheck.main, [], "the GPU check needs CUDA")


def test_a_chart_without_matplotlib_is_refused_before_timing(capsys, monkeypatch, nothing_is_timed, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" fail
    _refused(capsys, cli.main, ["--plot", str(tmp_path / "speedup.png")], "the chart needs matplotlib")


def test_gpucheck_arguments_are_checked(capsys, nothing_is_timed):
    _refused(capsys, gpucheck.main, ["--device", "cpu", "--repeats", "0"], "--repeats 0: at least 1 round")
    _refused(capsys, gpucheck.main, ["--device", "cpu", "--budget", "0"], "--budget 0")
    _refused(capsys, gpucheck.main, ["--device", "cpu", "--scale", "0.01"], "too small for one 2×2 stride cell")


def test_missing_and_unusable_checkpoints_are_refused(capsys, tmp_path, nothing_is_timed):
    from safetensors.torch import save_file

    _refused(capsys, cli.main, ["--checkpoint", str(tmp_path / "none.safetensors")], "no such file")
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a checkpoint")
    _refused(capsys, cli.main, ["--checkpoint", str(junk)], "not a readable .safetensors or .ckpt file")
    pickle = tmp_path / "junk.ckpt"
    pickle.write_bytes(b"\x00\x01 not a pickle")
    _refused(capsys, cli.main, ["--checkpoint", str(pickle)], "not a readable .safetensors or .ckpt file")
    vae = tmp_path / "vae.safetensors"
    save_file({"first_stage_model.decoder.conv_in.weight": torch.zeros(3)}, str(vae))
    _refused(capsys, cli.main, ["--checkpoint", str(vae)], "no U-Net in this checkpoint")
    broken = tmp_path / "broken.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(32, 4, 3, 3)}, str(broken))
    _refused(capsys, cli.main, ["--checkpoint", str(broken)], "not an SD 1.x/2.x/SDXL U-Net")


def test_a_ratio_above_the_cap_runs_and_shows_the_ratio_used(capsys):
    assert cli.main(["--models", "sd15", "--ratios", "0.9", "--sizes", "64", "--width", "0.1", "--repeats", "1",
                     "--quiet", "--skip", "block", "overhead", "memory", "--no-tomesd"]) == 0
    out = capsys.readouterr().out
    assert "ratio 0.9 is above the 2×2 stride's cap" in out and "0.75 is used" in out
    assert "| sd15 | 64 | ToMe | 0.75 |" in out


def test_command_line_errors_have_no_traceback():
    # Through the real entry points: what a user types.
    for module, args in (("tome_core.bench", ["--ratios", "1.5"]), ("tome_core.bench", ["--sizes", "500"])):
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("module", ["tome_core.bench", "tome_core.gpucheck"])
def test_entry_points_answer_help(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "--repeats" in done.stdout


@pytest.mark.parametrize("module", ["archs", "tensorfile", "checkpoint", "diffusers_folder", "pipeline", "sampling",
                                    "contenders", "timing", "metrics", "spread", "opcount", "report", "stepwise",
                                    "fidelity", "replicate", "sheet", "chart", "probes", "jobs", "arguments",
                                    "loading", "runs", "cli", "gpucheck", "proxy", "proxy.training"])
def test_each_bench_module_imports_alone_without_ldm(module):
    # A fresh interpreter per module: an import cycle shows only when a module of the cycle is imported first.
    code = (f"import sys, tome_core.bench.{module}; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('ldm', 'tomesd', 'matplotlib', 'PIL')], "
            "sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_engine_does_not_import_its_measurement_tools():
    code = "import sys, tome_core; assert not [m for m in sys.modules if m.startswith('tome_core.bench')]"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_ldm_loads_without_pillow_and_leaves_no_stand_in_behind():
    # A bare torch environment (the GPU check's) has no Pillow; ldm.util imports it for a helper the U-Net
    # never calls.
    code = """
import sys
class NoPillow:
    def find_spec(self, name, path=None, target=None):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("no Pillow here")
sys.meta_path.insert(0, NoPillow())
from tome_core.bench import archs
archs.require_ldm()
import ldm.modules.diffusionmodules.openaimodel
assert not [m for m in sys.modules if m.split(".")[0] == "PIL"]
try:
    import PIL
except ImportError:
    pass
else:
    raise AssertionError("a stand-in PIL stayed behind")
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- what a new user meets first ---------------------------------------------------------------------------------

def test_help_opens_with_what_the_tool_does_and_every_option_says_what_it_is():
    parser = arguments.build_parser()
    assert "`" not in parser.description and "python -m" not in parser.description
    undocumented = [a.option_strings for a in parser._actions if a.help is None]
    assert undocumented == []
    done = subprocess.run([sys.executable, "-m", "tome_core.bench", "--help"], capture_output=True, text=True,
                          cwd=ROOT)
    options = done.stdout[done.stdout.index("options:"):]
    skip = options[options.index("--skip"):]
    assert "leave out these measurements" in " ".join(skip.split()[:40])


def test_the_pictures_the_default_run_writes_are_ignored_by_git():
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    names = [arguments.DEFAULT_SHEET, "tradeoff.png", "speedup.png", "tome-fidelity-64px.png"]
    done = subprocess.run(["git", "check-ignore", *names], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.split() == names
    # Only at the top: the pictures the docs show (docs/images) stay tracked.
    kept = subprocess.run(["git", "check-ignore", "docs/images/proxy-tradeoff.png"], capture_output=True,
                          text=True, cwd=ROOT)
    assert kept.returncode == 1


def test_a_proxy_file_that_is_not_a_safetensors_file_is_one_line_and_exit_2(capsys, tmp_path, nothing_is_timed):
    junk = tmp_path / "notes.safetensors"
    junk.write_text("these are not weights, just text that happens to be long enough " * 4)
    _refused(capsys, cli.main, ["--proxy", str(junk)], f"--proxy {junk}: not a safetensors file")


def test_a_safetensors_file_of_another_kind_is_refused_briefly_without_pointing_training_at_it(
        capsys, tmp_path, nothing_is_timed):
    import json

    from safetensors.torch import save_file

    from tome_core.bench import proxy

    plain = tmp_path / "vae.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(3)}, str(plain))
    _refused(capsys, cli.main, ["--proxy", str(plain)], "not a proxy model's weights")
    other = tmp_path / "wide.safetensors"
    save_file({"context": torch.zeros(1, 4, 32)}, str(other),
              metadata={"arch": json.dumps(dict(proxy.PROXY_ARCH, model_channels=64))})
    assert cli.main(["--proxy", str(other)]) == 2
    err = capsys.readouterr().err
    assert "model_channels 64 where this code builds 32" in err and len(err) < 400, err
    assert json.dumps(proxy.PROXY_ARCH) not in err and str(proxy.PROXY_ARCH) not in err
    assert f"--out {other}" not in err and "--out proxy-seedN.safetensors" in err


@pytest.mark.parametrize("threads, suggested", [(None, True), (2, True), (1, False)])
def test_the_busy_hint_suggests_one_thread_only_to_a_run_that_used_more(threads, suggested):
    args = arguments.parse_args(["--models", "sd15", "--threads", str(threads)] if threads else ["--models", "sd15"])
    hint = runs.steadier_hint(args)
    assert "--repeats 6" in hint
    assert ("--threads 1" in hint) is suggested


def test_tomesd_is_raced_on_a_trained_model_only_when_asked_for():
    """The oracle's pictures are the paper's ToMe's, so the main job leaves it out (a fifth of its time); a speed
    run of the architectures, where it costs little, keeps it."""
    def left_out(argv):
        args = arguments.parse_args(argv)
        arguments.check_args(args)
        return args.no_tomesd

    assert left_out([]) and left_out(["--unprompted"])
    assert not left_out(["--tomesd"]) and not left_out(["--models", "sd15"])
    assert left_out(["--models", "sd15", "--no-tomesd"])
    # The two flags name one choice: given together they are refused, not settled silently.
    args = arguments.parse_args(["--tomesd", "--no-tomesd"])
    with pytest.raises(arguments.UsageError, match="--tomesd and --no-tomesd"):
        arguments.check_args(args)


def test_the_default_race_takes_the_sd15_layout_proxies_and_layouts_adds_the_sdxl_ones():
    """The default run stays a job a newcomer waits for: the three prompted SD 1.5-layout proxies, sampled with
    guidance as users sample; --layouts sd15 sdxl races the SDXL-layout ones too, a layout at a time; --unprompted
    the photograph-trained ones."""
    from tome_core.bench.loading import trained_groups

    def groups(argv):
        args = arguments.parse_args(argv)
        arguments.check_args(args)
        return [[(label, "SDXL" in pipe.name, bool(pipe.prompts)) for label, pipe in group]
                for group in trained_groups(args, torch.device("cpu"), torch.float32)]

    assert groups([]) == [[("seed 1", False, True), ("seed 2", False, True), ("seed 3", False, True)]]
    both = groups(["--layouts", "sd15", "sdxl"])
    # The samplers room and the proxy trainer say --layout: the race takes that spelling as the same option.
    assert arguments.parse_args(["--layout", "sd15", "sdxl"]).layouts == ["sd15", "sdxl"]
    assert [[(sdxl, prompted) for _, sdxl, prompted in group] for group in both] == [[(False, True)] * 3,
                                                                                     [(True, True)] * 3]
    assert groups(["--unprompted"]) == [[("seed 0", False, False), ("seed 1", False, False), ("seed 2", False, False)]]
