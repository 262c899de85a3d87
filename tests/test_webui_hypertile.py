"""ToMe beside the A1111 webui's built-in Hypertile (the double's ``builtin_scripts/hypertile_script.py``),
through whole jobs: Hypertile tiles whatever sequence its layers are handed as if it were the image grid, so on
the layers ToMe merges it is set aside for the job (console line, infotext record) and still tiles every
other layer. Hypertile's script is the A1111 webui's, so these tests run on the A1111 double alone."""

from __future__ import annotations

import pytest
import torch

from webui_double.testing import fresh, infotext_params, started_host, tome_keys  # noqa: F401  (fixtures)

HYPERTILE = "__webui_hypertile_params"


@pytest.fixture(scope="module")
def host():
    with started_host("a1111") as started:
        yield started


def hypertile_layers(unet) -> list:
    return [m for m in unet.modules() if HYPERTILE in vars(m)]


def switch_hypertile(on: bool) -> None:
    from modules import shared

    shared.opts.hypertile_enable_unet = on


@pytest.fixture
def hypertile(fresh):
    """The built-in Hypertile's layer states recorded at every U-Net call; its wrappers removed afterwards."""
    from modules import scripts

    module = next(s for s in scripts.scripts_data if s.script_class.__name__ == "ScriptHypertile").module
    states = []  # (hr, enabled flags of Hypertile's layers) at every U-Net call
    fresh.model.observers.append(lambda model, x, t, c: states.append(
        (tuple(x.shape), [getattr(m, HYPERTILE).enabled for m in hypertile_layers(model.unet)])))
    yield states
    module.unhook_model(fresh.model.unet)


def image(processed) -> torch.Tensor:
    return torch.as_tensor(processed.images[0])


def test_hypertile_alone_tiles_and_changes_the_image(hypertile, fresh):
    plain = image(fresh.txt2img())
    assert hypertile_layers(fresh.unet) == []  # never wrapped before it is first on
    switch_hypertile(True)
    tiled = fresh.txt2img()
    assert len(hypertile_layers(fresh.unet)) > 0
    assert all(flags and all(flags) for _, flags in hypertile[-3:])
    assert not torch.equal(image(tiled), plain)
    assert "Hypertile U-Net: True" in tiled.infotexts[0]


@pytest.mark.parametrize("method", ["ToMe", "ToDo"])
def test_tome_sets_hypertile_aside_on_the_layers_it_merges(hypertile, fresh, capsys, method):
    args = fresh.tome_args(enabled=True, ratio=0.5, method=method)
    alone = fresh.txt2img(args)  # what ToMe alone gives
    capsys.readouterr()
    hypertile.clear()

    switch_hypertile(True)
    both = fresh.txt2img(args)
    out = capsys.readouterr().out
    # Hypertile's layers here are exactly the ones ToMe merges (full latent resolution): all set aside while
    # sampling, so the image is ToMe's alone, where before it was Hypertile tiling merged tokens.
    assert hypertile and all(not any(flags) for _, flags in hypertile)
    assert torch.equal(image(both), image(alone))
    params = infotext_params(both.infotexts[0])
    assert params["Hypertile U-Net"] == "True"
    assert params["ToMe Hypertile"] == "set aside on merged blocks"
    assert "Hypertile is set aside on the" in out and out.count("[ToMe]") == 1
    # After the job Hypertile is as the user set it.
    assert all(getattr(m, HYPERTILE).enabled for m in hypertile_layers(fresh.unet))


def test_hires_only_leaves_hypertile_to_the_first_pass(hypertile, fresh):
    switch_hypertile(True)
    args = fresh.tome_args(enabled=True, ratio=0.5, hr_only=True)
    processed = fresh.txt2img(args, steps=2, enable_hr=True, hr_scale=1.5, hr_second_pass_steps=2,
                              denoising_strength=0.7)
    first = [flags for shape, flags in hypertile if shape[-1] == 16]
    hires = [flags for shape, flags in hypertile if shape[-1] == 24]
    assert first and all(all(flags) for flags in first)
    assert hires and all(not any(flags) for flags in hires)
    assert tome_keys(processed.infotexts[0])["ToMe Hypertile"] == "set aside on merged blocks"


def test_hypertile_off_writes_no_record(hypertile, fresh):
    switch_hypertile(True)
    fresh.txt2img()  # its layers wrapped, then off
    switch_hypertile(False)
    processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.5))
    assert "ToMe Hypertile" not in tome_keys(processed.infotexts[0])
