"""The samplers room (``tome_core.bench.samplers``): one line per shipped proxy and sampler, each contender's final
PSNR against the unmerged pictures of the same sampler and noise."""

from __future__ import annotations

import re

import pytest

import torch

from tome_core.bench import samplers
from tome_core.bench.loading import load_proxies
from tome_core.bench.fidelity import noise_for
from tome_core.bench.metrics import psnr

pytestmark = pytest.mark.usefixtures("webui_unet_for_this_test_only")


def test_one_line_per_proxy_and_sampler_with_each_contenders_psnr(capsys):
    threads = torch.get_num_threads()
    assert samplers.main(["--layout", "sd15", "--samplers", "euler", "euler_a", "--contenders", "todo", "cache2",
                          "--steps", "5", "--images", "1"]) == 0
    assert torch.get_num_threads() == threads  # its --threads is for its own run, not the caller's
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| seed")]
    assert len(rows) == 3 * 2
    assert all(re.fullmatch(r"\| seed \d \| (Euler|Euler a) \|( [\d.]+ \[[\d.]+–[\d.]+\] \|){2}", r) for r in rows)


def test_ancestral_noise_repeats_and_no_patch_gives_the_unmerged_picture():
    _, pipe = load_proxies(torch.device("cpu"), torch.float32)[0]
    noise = noise_for(pipe, pipe.size, 1, 0)
    a = samplers.final_pictures(pipe, noise, 3, "euler_a", 7, None)
    assert torch.equal(a, samplers.final_pictures(pipe, noise, 3, "euler_a", 7, None))
    other = samplers.final_pictures(pipe, noise, 3, "euler_a", 8, None)
    assert psnr(other, a) < 60  # another fresh noise: another picture
    todo = samplers.final_pictures(pipe, noise, 3, "euler_a", 7, samplers.CONTENDERS["todo"][1])
    assert not torch.equal(todo, a)
