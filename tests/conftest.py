import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# tests/comfyui/ runs in ComfyUI's own environment (tests/run.sh runs it there, with this variable set): the
# project's .venv has no ComfyUI, and ComfyUI's environment none of the WebUI doubles' packages.
collect_ignore = ["comfyui"] if not os.environ.get("TOKENMERGE_COMFYUI_RUN") else []


import pytest  # noqa: E402


@pytest.fixture
def webui_unet_for_this_test_only(monkeypatch):
    """The benchmark patches ldm process-wide as the webui does (SDP attention; ``archs.use_webui_unet``, also
    run by loading a proxy); take that back after the test, so other test files see ldm as it is."""
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)


@pytest.fixture(scope="module")
def one_thread_and_webui_ldm_for_this_module():
    """One thread (on a CPU shared with other work two threads spin against each other), and ldm as the webui
    patches it (``load_proxy`` does so process-wide) for the module's tests only: taken back after it."""
    import torch
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CrossAttention, "forward", CrossAttention.forward)
        mp.setattr(openaimodel, "th", openaimodel.th)
        yield
    torch.set_num_threads(threads)
