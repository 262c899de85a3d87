"""Fidelity beside speed: PSNR and SSIM against an independent implementation, exactness where nothing changes,
the side-by-side picture's grid, the dispatched operations a patched block adds, and the command line on a trained model
(a stand-in for the shipped proxy): every method in the table, bad inputs refused before anything runs, the
chart and the picture written. No test here asserts a speed."""

import math

import pytest
import torch

import tome_core
from tome_core.bench import archs, checkpoint, cli, jobs, runs
from tome_core.bench.contenders import Wrapped, roster
from tome_core.bench.fidelity import sample_pictures
from tome_core.bench.metrics import psnr, ssim
from tome_core.bench.opcount import added_cost, count_ops, ops_per_block
from tome_core.bench.report import Case, Entry, Fidelity
from tome_core.bench.sheet import case_rows, sheet_size, tile_side, write_case_sheet
from tome_core.bench.stepwise import step_errors
from tome_core.bench.tensorfile import CheckpointError
from bench_stand_ins import install_proxy, stand_in_pipeline
from unets import inputs, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")
SIZE = 16  # px: the stand-in is pixel space, so 16×16 pictures and a 16×16 top token grid


@pytest.fixture(autouse=True)
def webui_unet(monkeypatch):
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)
    archs.use_webui_unet()


def _pictures(seed=0):
    gen = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.interpolate(torch.rand(2, 3, 6, 7, generator=gen), size=(40, 48), mode="bilinear")
    noisy = (smooth + 0.05 * torch.randn(smooth.shape, generator=gen)).clamp(0, 1)
    return smooth, noisy


# -- PSNR and SSIM ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_psnr_and_ssim_agree_with_scikit_image(seed):
    metrics = pytest.importorskip("skimage.metrics")
    a, b = _pictures(seed)
    for i in range(a.shape[0]):
        x, y = a[i].double().numpy(), b[i].double().numpy()
        expected_ssim = metrics.structural_similarity(x, y, channel_axis=0, data_range=1.0, gaussian_weights=True,
                                                      sigma=1.5, use_sample_covariance=False)
        assert ssim(a[i], b[i]) == pytest.approx(expected_ssim, abs=1e-9)
        assert psnr(a[i], b[i]) == pytest.approx(metrics.peak_signal_noise_ratio(y, x, data_range=1.0), abs=1e-9)


def test_metrics_by_hand():
    # A uniform shift by d: MSE d², PSNR = −20 log10 d; on flat images SSIM's structure terms are
    # C2 / C2, so SSIM is the luminance term (2·μa·μb + C1) / (μa² + μb² + C1).
    a = torch.full((3, 16, 16), 0.5, dtype=torch.float64)
    b = a + 0.1
    assert psnr(b, a) == pytest.approx(20.0, abs=1e-9)
    c1 = 0.01 ** 2
    assert ssim(b, a) == pytest.approx((2 * 0.5 * 0.6 + c1) / (0.25 + 0.36 + c1), abs=1e-12)
    assert psnr(a, a) == math.inf and ssim(a, a) == 1.0
    with pytest.raises(ValueError, match="at least 11"):
        ssim(torch.zeros(3, 8, 8), torch.zeros(3, 8, 8))


# -- the sampling run ------------------------------------------------------------------------------------------

def test_unmerged_and_ratio_0_are_exact_and_a_real_merge_is_not():
    pipe = stand_in_pipeline()
    racers = roster([0.0, 0.5], [2], with_ideal=True)
    pictures = sample_pictures(pipe, racers, SIZE, steps=2)
    assert "ideal 0.50" not in pictures.images  # a speed bound, not a picture
    fid = pictures.fidelity(steps=step_errors(pipe, racers, pictures.trajectory))
    assert fid["none"] == Fidelity(math.inf, 1.0, math.inf, (math.inf, math.inf), (1.0, 1.0), (math.inf, math.inf))
    for name in ("ToMe 0.00", "tomesd 0.00"):
        assert torch.equal(pictures.images[name], pictures.images["none"]) and fid[name].psnr == math.inf
        assert fid[name].step == math.inf  # the same prediction at every step
    for name in ("ToMe 0.50", "ToDo f=2", "tomesd 0.50"):
        assert math.isfinite(fid[name].psnr) and fid[name].ssim < 1.0, name
        assert math.isfinite(fid[name].step) and fid[name].step > 0, name
    assert all(0 <= img.min() and img.max() <= 1 for img in pictures.images.values())
    again = sample_pictures(pipe, racers, SIZE, steps=2)  # seeded: every contender repeats, tomesd too
    assert all(torch.equal(again.images[k], v) for k, v in pictures.images.items())
    assert not tome_core.is_patched(pipe.unet)  # and tomesd's hooks are gone (it keeps its _tome_info dict)
    assert not pipe.unet._forward_pre_hooks


def test_without_a_decoder_the_sampled_tensors_are_compared():
    pipe = stand_in_pipeline(decode=False)
    pictures = sample_pictures(pipe, roster([0.5], [], with_tomesd=False, with_ideal=False), SIZE, steps=2)
    assert pictures.on_tensors
    ref = pictures.images["none"]
    assert ref.min() == 0 and ref.max() == 1  # mapped by the unmerged tensor's own range
    assert math.isfinite(pictures.fidelity()["ToMe 0.50"].psnr)


def test_side_by_side_has_a_row_per_method_and_the_unmerged_image_first(tmp_path):
    from PIL import Image

    pipe = stand_in_pipeline()
    racers = roster([0.3, 0.6], [2, 3, 4])
    pictures = sample_pictures(pipe, racers, SIZE, steps=1)
    entries = [Entry(c.name, c.method, c.setting, c.ideal) for c in racers]
    case = Case("stand-in", SIZE, entries, fidelity=pictures.fidelity())
    rows = case_rows(case, pictures)
    assert [label for label, _ in rows] == ["ToMe", "ToMe |diff|", "ToDo", "ToDo |diff|", "Local", "Local |diff|",
                                            "Stack", "Stack |diff|", "tomesd", "tomesd |diff|"]
    assert all(tiles[0].caption[0] == "no merging" for _, tiles in rows[::2])
    assert [len(tiles) for _, tiles in rows] == [3, 3, 4, 4, 3, 3, 3, 3, 3, 3]
    path = tmp_path / "sheet.png"
    size = write_case_sheet(str(path), case, pictures, "title")
    tile = tile_side(SIZE)
    assert tile >= 160 and tile % SIZE == 0  # small pictures enlarged by a whole factor
    assert Image.open(path).size == size == sheet_size(10, 4, tile)


# -- operations a patched block dispatches --------------------------------------------------------------------------

def test_todo_adds_fewer_ops_per_block_than_tome():
    # ToDo is one pooling of the keys and values per block; ToMe finds a merge, merges and unmerges.
    unet = tiny_unet("sd1")
    x, t, c = inputs(batch=1, h=16, w=16)  # 256 top-level tokens: small, and still merged at every ratio here
    wrapped = Wrapped(unet)
    plain = count_ops(unet, lambda: unet(x, t, context=c))
    added = {}
    for racer in roster([0.5], [2]):
        racer.apply(wrapped)
        try:
            added[racer.name] = ops_per_block(plain, count_ops(unet, lambda: unet(x, t, context=c)))
        finally:
            racer.remove(wrapped)
    assert added["none"] is None  # nothing patched, nothing to share out
    assert 0 < added["ToDo f=2"] < added["ToMe 0.50"]
    assert added["tomesd 0.50"] > 0 and added["ideal 0.50"] > 0
    assert plain.total > 0 and len(plain.per_block) == 10 and count_ops(unet, lambda: unet(x, t, context=c)) == plain


def test_stack_costs_few_ops_per_stack_and_removes_multiply_adds_as_its_ideal_does():
    """SDXL's layout at levels 4, ratio 0.5: Stack's operations per patched stack stay within 15 (the plan is
    one per level, merge and restore a few large operations); its multiply-adds fall below ToMe's, and its ideal
    (every block of the stacks on half the tokens, for free) bounds it from below, with the U-Net's convolutions
    and the stacks' projections in and out left whole."""
    unet = tiny_unet("sdxl")
    x, t, c = inputs(batch=2, h=32, w=32)
    wrapped = Wrapped(unet)
    unet(x, t, context=c)
    plain = count_ops(unet, lambda: unet(x, t, context=c))
    costs = {}
    for racer in roster([0.5], [2], max_downsample=4, with_tomesd=False):
        racer.apply(wrapped)
        try:
            unet(x, t, context=c)  # tables made once per grid are not what a step costs
            costs[racer.name] = added_cost(plain, count_ops(unet, lambda: unet(x, t, context=c)))
        finally:
            racer.remove(wrapped)
    stack, ideal, tome = costs["Stack 0.50"], costs["ideal S 0.50"], costs["ToMe 0.50"]
    assert 0 < stack.per_stack <= 15
    assert ideal.multiply_adds < stack.multiply_adds < tome.multiply_adds < 1.0
    assert stack.multiply_adds - ideal.multiply_adds < 0.02  # the plan's own products are small
    assert plain.multiply_adds > 0 and costs["none"].multiply_adds == 1.0


# -- the command line on a trained model -----------------------------------------------------------------------

@pytest.fixture
def steady_timer(monkeypatch):
    # Timing is not under test here: every call "takes" a fixed time, per method.
    monkeypatch.setattr(jobs, "model_timer", lambda *a: (lambda name: {"none": 10.0}.get(name, 8.0)))


def test_the_default_run_reports_every_method_with_speed_and_fidelity(monkeypatch, capsys, tmp_path, steady_timer):
    calls = install_proxy(monkeypatch)
    sheet, plot = tmp_path / "sheet.png", tmp_path / "chart.png"
    assert cli.main(["--sizes", str(SIZE), "--steps", "2", "--repeats", "1", "--quiet", "--sheet", str(sheet),
                     "--plot", str(plot), "--device", "cpu", "--tomesd"]) == 0
    assert calls == [(torch.device("cpu"), torch.float32)]
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(f"| stand-in proxy | {SIZE} |")]
    methods = [(line.split("|")[3].strip(), line.split("|")[4].strip()) for line in lines]
    assert methods == [("none", "–"), ("ToMe", "0.25"), ("ToMe", "0.50"), ("ToMe", "0.75"), ("ToDo", "f=2"),
                       ("ToDo", "f=3"), ("ToDo", "f=4"), ("Local", "0.25"), ("Local", "0.50"), ("Local", "0.75"),
                       ("Stack", "0.25"), ("Stack", "0.50"), ("Stack", "0.75"), ("tomesd", "0.25"), ("tomesd", "0.50"),
                       ("tomesd", "0.75"), ("ideal", "0.25"), ("ideal", "0.50"), ("ideal", "0.75"),
                       ("ideal", "KV 0.25"), ("ideal", "KV 0.50"), ("ideal", "KV 0.75"),
                       ("ideal", "S 0.25"), ("ideal", "S 0.50"), ("ideal", "S 0.75")]
    cells = {m: line.strip("|").split("|") for m, line in zip(methods, lines)}
    assert [c.strip() for c in cells[("none", "–")][4:]] == ["10.0 (0%)", "1.00x", "–", "∞", "1.000", "∞", "0", "0",
                                                             "1.00"]
    for key in [m for m in methods if m[0] in ("ToMe", "ToDo", "Local", "Stack", "tomesd")]:
        psnr_cell, ssim_cell, step_cell, ops_cell = (c.strip().split()[0] for c in cells[key][7:11])
        assert math.isfinite(float(psnr_cell)) and float(ssim_cell) <= 1 and float(ops_cell) > 0, key
        assert math.isfinite(float(step_cell)), key
    assert "the decoded images after 2 Euler steps" in out
    assert sheet.read_bytes()[:4] == b"\x89PNG" and plot.read_bytes()[:4] == b"\x89PNG"


def _numbers(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_the_default_run_measures_every_shipped_proxy_and_says_what_holds_on_all(monkeypatch, capsys, tmp_path,
                                                                                 steady_timer):
    shipped = ("p0.safetensors", "p1.safetensors", "p2.safetensors")
    calls = install_proxy(monkeypatch, shipped=shipped)
    sheet = tmp_path / "sheet.png"
    assert cli.main(["--sizes", str(SIZE), "--steps", "2", "--repeats", "1", "--quiet", "--sheet", str(sheet),
                     "--device", "cpu", "--ratios", "0.25", "0.75", "--todo-factors", "2", "--images", "2",
                     "--no-tomesd"]) == 0
    assert [c[2] for c in calls] == list(shipped)
    out = capsys.readouterr().out
    assert "# models: 3 proxies (seed 0, seed 1, seed 2)" in out and f"# writes {sheet}" in out
    sections = out.split("\n## ")
    main = next(s for s in sections if s.startswith("stand-in proxy: speed and fidelity"))
    for measure, column in (("final-picture PSNR dB", 7), ("one-step dB", 9)):
        table = next(s for s in sections if s.startswith(f"stand-in proxy at {SIZE} px, {measure} on each proxy"))
        assert "| method | setting | seed 0 | seed 1 | seed 2 | median |" in table
        for name in ("ToMe | 0.25", "Local | 0.75", "ToDo | f=2"):
            row = _numbers(next(line for line in table.splitlines() if f"| {name} |" in line))
            each = sorted(float(cell.split()[0]) for cell in row[2:5])
            assert float(row[5]) == each[1], (measure, name)  # the median of the three proxies' medians
            in_main = _numbers(next(line for line in main.splitlines() if f"| {name} |" in line))[column]
            assert in_main == f"{each[1]:.1f} ({each[0]:.1f}–{each[2]:.1f})", (measure, name, in_main)
    holds = next(s for s in sections if s.startswith(f"stand-in proxy at {SIZE} px: orderings that hold"))
    assert "### final-picture PSNR dB:" in holds and "### one-step dB:" in holds
    assert sheet.read_bytes()[:4] == b"\x89PNG"


def test_a_missing_shipped_proxy_is_named_with_the_command_that_makes_it(monkeypatch, capsys, steady_timer):
    shipped = ("p0.safetensors", "p1.safetensors", "p2.safetensors")
    calls = install_proxy(monkeypatch, shipped=shipped, missing=("p2.safetensors",))
    assert cli.main(["--sizes", str(SIZE), "--steps", "1", "--repeats", "1", "--quiet", "--sheet", "", "--device",
                     "cpu", "--ratios", "0.5", "--todo-factors", "2", "--images", "1", "--no-tomesd"]) == 0
    assert [c[2] for c in calls] == ["p0.safetensors", "p1.safetensors"]
    out = capsys.readouterr().out
    assert "# models: 2 proxies (seed 0, seed 1)" in out
    assert "# note: shipped proxy p2.safetensors is missing, so not measured: python -m tome_core.bench.proxy " \
           "train --seed 2" in out


def test_another_proxy_is_measured_from_its_weights_file(monkeypatch, capsys, tmp_path, steady_timer):
    calls = install_proxy(monkeypatch)
    weights = tmp_path / "proxy-seed1.safetensors"
    weights.write_bytes(b"weights")
    assert cli.main(["--proxy", str(weights), "--sizes", str(SIZE), "--steps", "1", "--repeats", "1", "--quiet",
                     "--sheet", "", "--device", "cpu", "--ratios", "0.5", "--todo-factors", "2"]) == 0
    assert calls == [(torch.device("cpu"), torch.float32, str(weights))]
    out = capsys.readouterr().out
    assert f"# note: proxy weights: {weights}" in out and f"| stand-in proxy | {SIZE} | Local | 0.50 |" in out
    _refused(capsys, ["--proxy", str(tmp_path / "missing.safetensors")], "missing.safetensors: no such file")
    for other in (["--models", "sd15"], ["--checkpoint", str(weights)]):
        _refused(capsys, ["--proxy", str(weights)] + other, "--proxy with --models or --checkpoint: give one model")


def test_random_weights_say_they_give_no_fidelity(capsys, steady_timer, tmp_path):
    plot = tmp_path / "speed.png"
    assert cli.main(["--models", "sd15", "--sizes", "64", "--width", "0.1", "--repeats", "1", "--quiet", "--skip",
                     "block", "overhead", "memory", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "Random weights: no fidelity figure" in out and "| sd15 | 64 | ToDo | f=2 |" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def nothing_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("started")

    for module, name in ((jobs, "model_timer"), (jobs, "sample_pictures"), (jobs, "count_ops"),
                         (archs, "build_unet"), (runs, "merge_overhead")):
        monkeypatch.setattr(module, name, refuse)


def _refused(capsys, argv, expected):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert expected in err and "Traceback" not in err


@pytest.mark.parametrize("argv, expected", [
    (["--sizes", "36"], "--sizes 36: stand-in proxy takes sizes that are multiples of 8 px"),
    (["--sizes", "8"], "--sizes 8: the compared images would be 8×8, smaller than SSIM's 11×11 window"),
    (["--todo-factors", "1"], "--todo-factors 1: a ToDo factor must be a whole number from 2 to 8"),
    (["--steps", "0"], "--steps 0: at least 1 step is needed"),
    (["--images", "0"], "--images 0: at least 1 is needed"),
    (["--sheet", "/no/such/folder/s.png"], "--sheet /no/such/folder/s.png: no folder /no/such/folder"),
    (["--models", "sd15", "--checkpoint", "x.safetensors"], "--models and --checkpoint: give one"),
    (["--max-downsample", "1", "--sizes", "32"], None),  # the stand-in has attention at full resolution: fine
])
def test_bad_inputs_on_a_trained_model_are_one_line_and_exit_2(monkeypatch, capsys, nothing_runs, argv, expected):
    install_proxy(monkeypatch)
    if expected is None:
        with pytest.raises(AssertionError, match="started"):
            cli.main(argv + ["--quiet", "--sheet", ""])
        return
    _refused(capsys, argv, expected)


@pytest.mark.parametrize("problem", ["no VAE (first_stage_model.*) in this checkpoint",
                                     "an SD3 checkpoint, not an SD 1.x/2.x/SDXL U-Net",
                                     "not a readable .safetensors or .ckpt file (header too large)"])
def test_a_checkpoint_the_loader_refuses_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, nothing_runs,
                                                                problem):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"anything")

    def load_pipeline(file, device, dtype, prediction="auto"):
        raise CheckpointError(f"--checkpoint {file}: {problem}")

    monkeypatch.setattr(checkpoint, "load_pipeline", load_pipeline, raising=False)
    _refused(capsys, ["--checkpoint", str(path)], problem)


def test_the_gpu_check_measures_fidelity_on_the_proxy(monkeypatch, capsys, steady_timer):
    from tome_core.bench import gpucheck

    install_proxy(monkeypatch)
    # Only the fidelity section: the random-weight speed cases are the other GPU check test's.
    args = gpucheck.parse_args(["--device", "cpu", "--steps", "2", "--repeats", "1", "--quiet"])
    gpucheck.proxy_fidelity(args, torch.device("cpu"), torch.float32)
    out = capsys.readouterr().out
    assert "## stand-in proxy: speed and fidelity at 16 px" in out
    for method in ("none | –", "ToMe | 0.50", "ToDo | f=2", "ToDo | f=4", "Local | 0.75", "tomesd | 0.75",
                   "ideal | 0.25", "ideal | KV 0.25"):
        assert f"| stand-in proxy | 16 | {method} |" in out, method
    assert "the decoded images after 2 Euler steps" in out


def test_the_gpu_check_says_when_there_is_no_proxy(monkeypatch, capsys):
    from tome_core.bench import gpucheck

    monkeypatch.setattr(gpucheck, "load_proxy_pipeline", lambda device, dtype: None)
    gpucheck.proxy_fidelity(gpucheck.parse_args(["--device", "cpu"]), torch.device("cpu"), torch.float32)
    assert "no fidelity figure" in capsys.readouterr().out


def test_the_ideal_lines_labels_do_not_overprint_each_other():
    from tome_core.bench.chart import label_positions, tradeoff_figure
    from tome_core.bench.timing import Spread

    # The ideals' speed-ups as the proxy gives them: several within a hundredth of each other.
    speeds = {"none": 1.0, "ToMe 0.50": 1.41, "ideal 0.25": 1.42, "ideal 0.50": 1.76, "ideal 0.75": 2.01,
              "ideal KV 0.25": 1.19, "ideal KV 0.50": 1.34, "ideal KV 0.75": 1.65, "ideal KV 0.80": 1.66}
    entries = [Entry(n, n.split()[0], " ".join(n.split()[1:]) or "–") for n in speeds]
    ms = {n: Spread(100 / v, 100 / v, 100 / v, 100 / v, 100 / v, 3) for n, v in speeds.items()}
    fid = {"none": Fidelity(math.inf, 1.0, math.inf), "ToMe 0.50": Fidelity(45.0, 0.99, 38.0, (44.0, 46.0))}
    fig = tradeoff_figure([Case("proxy", 64, entries, ms, fid)], "title")
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text().startswith("ideal")]
        assert len(boxes) == 7
        overlaps = [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
        assert overlaps == []
    # Spread apart by at least the gap, in the order of their values, each as near its own as that allows.
    # By hand: 1.0, 1.02 and 1.05 form one group spaced by 0.1 around their mean 1.0233; 3.0 stays put.
    mean = (1.0 + 1.02 + 1.05) / 3
    assert label_positions([1.0, 1.05, 1.02, 3.0], 0.1) == pytest.approx([mean - 0.1, mean + 0.1, mean, 3.0])
    assert label_positions([1.0, 2.0], 0.1) == [1.0, 2.0]
