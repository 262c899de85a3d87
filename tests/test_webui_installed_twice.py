"""The extension installed twice (a clone and an "Install from URL" beside it): the second copy steps aside with
one console line naming both folders, and jobs are merged once, as with one copy."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from webui_double.testing import EXTENSION_DIR, started_host, tome_keys

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    copy = str(tmp_path_factory.mktemp("extensions") / "sd-webui-tokenmerge-copy")
    for folder in ("scripts", "javascript"):
        shutil.copytree(os.path.join(EXTENSION_DIR, folder), os.path.join(copy, folder))
    with started_host("a1111") as host:
        from webui_double.host import Webui

        single = host.txt2img(host.tome_args(enabled=True, ratio=0.5), seed=5)
        host.webui.unload()
        host.webui = Webui(EXTENSION_DIR, more_extension_dirs=(copy,))
        yield host, copy, single


def test_the_second_copy_steps_aside_with_one_line_naming_both_folders(twice, capsys):
    host, copy, _ = twice
    for tab, runner in host.webui.runners.items():
        assert [s.title() for s in runner.alwayson_scripts].count("ToMe") == 1, tab
    from webui_double.host import Webui

    host.webui.unload()
    capsys.readouterr()
    host.webui = Webui(EXTENSION_DIR, more_extension_dirs=(copy,))  # "Reload UI": the same copy runs again
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[ToMe]")]
    assert len(lines) == 1 and EXTENSION_DIR in lines[0] and copy in lines[0] and "steps aside" in lines[0]
    assert lines[0].index(EXTENSION_DIR) < lines[0].index(copy)  # the first copy loaded is the one that runs


def test_jobs_are_merged_once_and_reproducibly_as_with_one_copy(twice):
    host, _, single = twice
    job = host.txt2img(host.tome_args(enabled=True, ratio=0.5), seed=5)
    assert torch.equal(job.images[0], single.images[0])
    assert tome_keys(job.infotexts[0]) == tome_keys(single.infotexts[0]) != {}
    host.assert_pristine()
