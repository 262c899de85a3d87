"""The engine as a library: ``pip install <this repository>`` ships ``tome_core`` alone, needing only torch,
and importing it (and patching a diffusers U-Net with it) loads no diffusers, ldm, sgm or host code. The
benchmark's proxy weights stay in the repository: the wheel leaves them out, and the installed benchmark says
where they are in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what a clone holds (setuptools writes build folders beside the sources), with the
    # venv's own setuptools (no build isolation), so the test downloads nothing.
    source = tmp_path_factory.mktemp("source")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), source)
    shutil.copy(os.path.join(ROOT, "README.md"), source)
    shutil.copytree(os.path.join(ROOT, "tome_core"), source / "tome_core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out), str(source)], check=True, capture_output=True, text=True)
    (path,) = out.glob("*.whl")
    return path


def test_wheel_ships_the_engine_only_with_torch_as_its_dependency(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tome_core"}
    assert "tome_core/families.py" in names and "tome_core/bench/proxy/__init__.py" in names
    assert not [n for n in names if n.endswith(".safetensors") or "/weights/" in n]
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["Requires-Dist: torch>=2.0"]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed into a folder of its own, and the environment that imports it from there alone."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The installed copy first; the repository's folder is not on the path (cwd is elsewhere).
    env["PYTHONPATH"] = str(target)
    return target, env


def test_installed_wheel_patches_a_diffusers_unet_without_importing_diffusers_itself(installed, tmp_path):
    target, env = installed
    code = (
        "import sys, tome_core\n"
        "assert tome_core.__file__.startswith(sys.argv[1]), tome_core.__file__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('diffusers', 'ldm', 'sgm', 'modules', 'gradio')]\n"
        "from diffusers import UNet2DConditionModel\n"
        "unet = UNet2DConditionModel(block_out_channels=(32, 64), down_block_types=('CrossAttnDownBlock2D', "
        "'DownBlock2D'), up_block_types=('UpBlock2D', 'CrossAttnUpBlock2D'), layers_per_block=1, "
        "cross_attention_dim=16, norm_num_groups=8, attention_head_dim=2)\n"
        "tome_core.apply_patch(unet, ratio=0.5)\n"
        "print(len(tome_core.patched_blocks(unet)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"  # level 0: one transformer going down, two coming up


def test_installed_benchmark_without_the_weights_says_where_they_are_in_one_line(installed, tmp_path):
    _, env = installed
    done = subprocess.run([sys.executable, "-m", "tome_core.bench", "--device", "cpu", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "tome_core/bench/weights/" in done.stderr and "--proxy FILE" in done.stderr
    assert "checkout" in done.stderr
