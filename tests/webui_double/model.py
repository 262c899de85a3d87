"""A real, tiny SD 1.x-layout ldm U-Net, wrapped like the webui's ``shared.sd_model``."""

from __future__ import annotations

import zlib
from typing import Any, Callable

import torch
from torch import nn

CONTEXT_DIM = 32


LAYOUTS = {
    "sd1": dict(attention_resolutions=[4, 2, 1], channel_mult=[1, 2, 4, 4]),
    # SDXL's level structure: no attention at full latent resolution.
    "sdxl": dict(attention_resolutions=[4, 2], channel_mult=[1, 2, 4]),
}


def tiny_unet(seed: int = 0, layout: str = "sd1") -> nn.Module:
    """SD 1.x levels (attention at downsample 1, 2, 4 and in the middle block) or SDXL's (attention from
    downsample 2 on), 32 base channels, 2 heads.

    ldm zero-initialises every ``proj_out`` and the output conv, which would make every transformer block a
    no-op and every output zero; they get random values so that a patch shows in the output.
    """
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(seed)
    unet = UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                     num_heads=2, use_spatial_transformer=True, transformer_depth=1, context_dim=CONTEXT_DIM,
                     legacy=False, **LAYOUTS[layout])
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in unet.named_parameters():
            if ".proj_out." in name or name.startswith("out."):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return unet.eval()


def text_conditioning(prompts: list[str], tokens: int = 8) -> torch.Tensor:
    """Text conditioning stand-in: a fixed (tokens, CONTEXT_DIM) tensor per prompt."""
    return torch.stack([torch.randn(tokens, CONTEXT_DIM, generator=torch.Generator().manual_seed(
        zlib.crc32(prompt.encode()))) for prompt in prompts])


class DiffusionWrapper(nn.Module):
    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.diffusion_model = unet

    def forward(self, x, t, c_crossattn=None):
        return self.diffusion_model(x, t, context=c_crossattn)


class TinySDModel(nn.Module):
    """``shared.sd_model`` of an SD 1.x checkpoint: the U-Net at ``model.diffusion_model`` and the webui's
    model flags. ``observers`` are called before every U-Net call (tests record state there, or raise)."""

    is_sd1, is_sd2, is_sdxl, is_ssd, is_sd3 = True, False, False, False, False
    parameterization = "eps"

    def __init__(self, unet: nn.Module | None = None) -> None:
        super().__init__()
        self.model = DiffusionWrapper(unet if unet is not None else tiny_unet())
        self.observers: list[Callable[..., None]] = []
        self.sd_checkpoint_info = None

    @property
    def unet(self) -> nn.Module:
        return self.model.diffusion_model

    def load_unet_weights(self, state_dict: dict) -> None:
        self.unet.load_state_dict(state_dict)

    def builtin_token_merging_on(self) -> bool:
        """The webui's built-in (tomesd) patch is on."""
        return any(type(m).__name__ == "ToMeBlock" for m in self.modules())

    def get_learned_conditioning(self, prompts: list[str]) -> torch.Tensor:
        return text_conditioning(prompts)

    def apply_model(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for observer in list(self.observers):
            observer(self, x, t, cond)
        from modules import sd_unet  # importable only once the double is installed

        if sd_unet.current_unet is not None:  # the webui routes the U-Net's forward to the alternative
            return sd_unet.current_unet.forward(x, t, cond)
        return self.model(x, t, c_crossattn=cond)


def fixed_input(batch: int = 2, size: int = 32, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, size, size, generator=generator)
    t = torch.full((batch,), 749.25)
    context = torch.randn(batch, 8, CONTEXT_DIM, generator=generator)
    return x, t, context


def hook_count(module: nn.Module) -> int:
    """Forward hooks of every kind on every submodule."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
             "_backward_hooks", "_backward_pre_hooks")
    return sum(len(getattr(m, kind, ())) for m in module.modules() for kind in kinds)


# The webui's built-in token merging (tomesd) leaves this behind after its own remove_patch: host residue.
BUILTIN_RESIDUE = frozenset({"_tome_info"})


def module_fingerprint(module: nn.Module) -> list[tuple[str, type, tuple[str, ...]]]:
    """Class and instance attribute names of every submodule: any patch residue changes it."""
    return [(name, type(m), tuple(sorted(set(vars(m)) - BUILTIN_RESIDUE))) for name, m in module.named_modules()]


def snapshot(model: Any) -> dict[str, Any]:
    """What "unpatched" means: the U-Net's output on a fixed input, its hooks and its module structure."""
    unet = model.unet
    x, t, context = fixed_input()
    with torch.no_grad():
        output = unet(x, t, context=context)
    return {"output": output, "hooks": hook_count(unet), "modules": module_fingerprint(unet)}
