"""The shipped proxy model: a small SD 1.x-layout U-Net trained here on real photographs, in pixel space.

Why it exists: a fidelity figure (the same sampling run with and without a merging method, final pictures
compared) needs a model whose tokens carry an image's redundancy. Random weights do not (ToMe moved their
output as much on photographs as on Gaussian noise), and a user's checkpoint is not always at hand. This model
is a proxy that ranks methods, not an FID: its pictures are 64×64 px textures in photographs' colours, not SD's
images, and merging moves it far less than it moves SD (PSNR in the 40s of dB at ratio 0.5), so its fidelity
figures order methods and ratios; they do not predict what a user will see.

Layout: ldm's ``UNetModel`` as SD 1.x builds it (SpatialTransformers with one BasicTransformerBlock at
downsampling 1, 2 and 4, none in the lowest level's input/output blocks, one in the middle block; conv 1×1
projections; fixed head count), at small widths, taking and predicting 3-channel pixels in [-1, 1]. At 64×64 px
its top level holds 4,096 tokens, as SD 1.5's does at 512×512 px. Its "empty prompt" is a learned (1, 4, 32)
context stored with the weights, so cross-attention sees a fixed conditioning as in SD's unconditional pass.
The SDXL layout (``LAYOUTS["sdxl"]``) has SDXL's attention levels at small widths.

A prompted proxy (``train --data scenes``, docs/proxy.md) is the same U-Net trained on scenes a prompt
describes (``scenes``): its context is a ``PromptEncoder``'s embedding of the prompt's words, the empty prompt
is guidance's unconditional half, and the benchmark asks for ``BENCHMARK_PROMPTS`` in turn.

This package holds the model: its layouts, building it, loading the shipped (or given) weights as a sampling
``Pipeline``. How the weights were made is ``training`` (``python -m tome_core.bench.proxy train --seed 0 --out
FILE``: the photographs, the crops, the training loop, the saved file); the command line is ``__main__``.

Loading (``load_proxy``) needs only torch, ldm and safetensors: the photograph packages are for training and
tests.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..archs import context_as_list, in_run_dtype, require_ldm, trim_depths, use_webui_unet
from ..pipeline import Pipeline

# The shipped weights are the repository's (a clone carries them), not the package's: the engine's wheel
# leaves them out, so a pip-installed library has no such folder.
WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")
REPOSITORY_WEIGHTS_DIR = "tome_core/bench/weights"  # the same folder, as a checkout names it
NOT_INSTALLED = (f"the shipped proxy models' weights are not installed here: they are in the repository's "
                 f"{REPOSITORY_WEIGHTS_DIR}/, which a pip install of the engine leaves out; run from a checkout "
                 f"of the repository, or give a proxy's weights file (python -m tome_core.bench --proxy FILE)")
WEIGHTS_FILE = os.path.join(WEIGHTS_DIR, "proxy_weights.safetensors")  # seed 0, the first of the shipped proxies
# Every shipped proxy, each trained by ``train`` with the default stages from its own seed: the default run
# measures fidelity on each, since one proxy's figures do not all replicate on another.
SHIPPED_WEIGHTS = (WEIGHTS_FILE, os.path.join(WEIGHTS_DIR, "proxy_weights_seed1.safetensors"),
                   os.path.join(WEIGHTS_DIR, "proxy_weights_seed2.safetensors"))
# The SDXL-layout proxies (``--layout sdxl``), seeds 0, 1 and 2: the default run races them after the others.
SHIPPED_SDXL_WEIGHTS = tuple(os.path.join(WEIGHTS_DIR, f"proxy_weights_sdxl_seed{k}.safetensors") for k in range(3))
# The prompted proxies (``--data scenes``), SD 1.5's layout and SDXL's (``--layout sdxl``), three each: every
# attention level matters to their pictures (docs/proxy.md#prompted-proxies), and they are sampled with a prompt
# and guidance as users sample, so the benchmark races them by default; the main job's SDXL figure measures the
# first SDXL one. The photograph-trained ones above stay for ``--unprompted`` and the tests.
# SDXL's are seeds 0, 1 and 2; SD 1.5's seeds 1, 2 and 3, since its recipe's seed 0 trained a proxy whose
# 256-token level, skipped, moved the pictures to 20.5 dB, just outside the bar (docs/proxy.md, "The shipped
# prompted SD 1.5-layout proxies").
SHIPPED_PROMPTED_SEEDS = (1, 2, 3)
SHIPPED_PROMPTED_WEIGHTS = tuple(os.path.join(WEIGHTS_DIR, f"proxy_weights_prompted_seed{k}.safetensors")
                                 for k in SHIPPED_PROMPTED_SEEDS)
SHIPPED_PROMPTED_SDXL_WEIGHTS = tuple(os.path.join(WEIGHTS_DIR, f"proxy_weights_sdxl_prompted_seed{k}.safetensors")
                                      for k in range(3))


def shipped_weights(layouts: tuple[str, ...] = ("sd15", "sdxl"), prompted: bool = True) -> tuple[list[str], list[str]]:
    """The shipped proxies' weight files of ``layouts`` that are here, and those that are not (each missing one
    is made by ``train_command``): the prompted ones, or with ``prompted=False`` the photograph-trained ones."""
    sd15, sdxl = ((SHIPPED_PROMPTED_WEIGHTS, SHIPPED_PROMPTED_SDXL_WEIGHTS) if prompted
                  else (SHIPPED_WEIGHTS, SHIPPED_SDXL_WEIGHTS))
    files = (sd15 if "sd15" in layouts else ()) + (sdxl if "sdxl" in layouts else ())
    here = [p for p in files if os.path.isfile(p)]
    return here, [p for p in files if p not in here]


def train_command(path: str) -> str:
    """The command that makes the shipped proxy file ``path`` again (its seed is its place in
    ``SHIPPED_WEIGHTS``, ``SHIPPED_SDXL_WEIGHTS`` or ``SHIPPED_PROMPTED_SDXL_WEIGHTS``; for
    ``SHIPPED_PROMPTED_WEIGHTS``, the seed ``SHIPPED_PROMPTED_SEEDS`` gives at that place)."""
    if path in SHIPPED_PROMPTED_WEIGHTS:
        seed = SHIPPED_PROMPTED_SEEDS[SHIPPED_PROMPTED_WEIGHTS.index(path)]
        return f"python -m tome_core.bench.proxy train --data scenes --seed {seed} --out {path}"
    if path in SHIPPED_PROMPTED_SDXL_WEIGHTS:
        return (f"python -m tome_core.bench.proxy train --layout sdxl --data scenes "
                f"--seed {SHIPPED_PROMPTED_SDXL_WEIGHTS.index(path)} --out {path}")
    if path in SHIPPED_SDXL_WEIGHTS:
        return (f"python -m tome_core.bench.proxy train --layout sdxl --seed {SHIPPED_SDXL_WEIGHTS.index(path)} "
                f"--out {path}")
    seed = SHIPPED_WEIGHTS.index(path) if path in SHIPPED_WEIGHTS else 0
    return f"python -m tome_core.bench.proxy train --seed {seed} --out {path}"


EVAL_SIZE = 64  # px per side at which fidelity runs and tests use the model: 4,096 tokens at the top level
CONTEXT_TOKENS, CONTEXT_DIM = 4, 32

# ldm UNetModel arguments: SD 1.x's layout (four levels, attention at downsampling 1, 2 and 4 and in the middle
# block, none in the lowest level's input/output blocks, conv projections, a fixed number of heads) at 1/10 of
# its width and one residual block per level instead of two: 3.8 M parameters (7.6 MB in float16), and a
# training step cheap enough for a 30-minute CPU budget.
PROXY_ARCH = dict(image_size=EVAL_SIZE, in_channels=3, out_channels=3, model_channels=32, channel_mult=[1, 2, 2, 4],
                  num_res_blocks=1, attention_resolutions=[4, 2, 1], num_heads=2, use_spatial_transformer=True,
                  transformer_depth=1, context_dim=CONTEXT_DIM, use_linear_in_transformer=False, legacy=False)

# SDXL's layout at small widths, for methods that act at SDXL's levels: no attention at full resolution, two
# blocks a transformer at downsampling 2 and a deep stack (ten, as SDXL's) at 4, linear projections, a fixed head
# width; one residual block per level. At 128×128 px its attention levels hold 4,096 and 1,024 tokens, as
# SDXL's do at 1024 px. Built at depth 10 and trimmed (``SDXL_PROXY_DEPTHS``), as the benchmark builds SDXL.
SDXL_EVAL_SIZE = 128
SDXL_PROXY_ARCH = dict(image_size=SDXL_EVAL_SIZE, in_channels=3, out_channels=3, model_channels=32,
                       channel_mult=[1, 1, 2], num_res_blocks=1, attention_resolutions=[4, 2], num_head_channels=16,
                       use_spatial_transformer=True, transformer_depth=10, context_dim=[CONTEXT_DIM] * 10,
                       use_linear_in_transformer=True, legacy=False)
SDXL_PROXY_DEPTHS = {1: 2, 2: 10}


@dataclass(frozen=True)
class ProxyLayout:
    """One proxy architecture: ldm ``UNetModel`` arguments, per-level transformer depths (None: as built), the
    evaluation size in px and the default training stages ((crop side px, steps, batch), run in order)."""

    name: str
    arch: dict
    depths: dict | None
    eval_size: int
    stages: tuple[tuple[int, int, int], ...]


LAYOUTS = {
    # Most steps at 16 px (attention cost grows with the square of the tokens), then 32 px, then the evaluation
    # size, so the top level's attention has seen 4,096 tokens: about an hour on one CPU thread. Half these
    # steps (a quarter at 64 px) trained proxies that ordered the methods alike but whose figures lay nearly
    # twice as far apart between seeds.
    "sd15": ProxyLayout("sd15", PROXY_ARCH, None, EVAL_SIZE, ((16, 1600, 32), (32, 400, 16), (64, 160, 4))),
    # SD 1.5's recipe one size up at every stage would take four hours; most steps stay small here and the
    # last stage, at the evaluation size where the attention levels see 4,096 and 1,024 tokens, is short:
    # about 26 minutes on one CPU thread.
    "sdxl": ProxyLayout("sdxl", SDXL_PROXY_ARCH, SDXL_PROXY_DEPTHS, SDXL_EVAL_SIZE,
                        ((32, 1200, 16), (64, 400, 4), (128, 80, 2))),
}


# The prompted proxies' recipes (``train --data scenes``): scenes a prompt describes (``scenes``), most steps at
# the small sizes, where a step is cheap, then the evaluation size (docs/proxy.md#prompted-proxies has each
# try's figures). Longer last stages at a higher learning rate
# (``--lr-floor 0.1``) let the highest attention level take over more, not the deep one.
PROMPTED_STAGES = {
    # The first size's stage in two parts, the first for the curriculum (``PROMPTED_CURRICULUM``): three
    # quarters of it for SD 1.5, half for SDXL.
    "sd15": ((16, 600, 32), (16, 200, 32), (32, 600, 16), (64, 300, 4)),
    "sdxl": ((32, 300, 16), (32, 300, 16), (64, 500, 8), (128, 150, 2)),
}
# Their levels' widths (``channel_mult``; None: the layout's). SDXL's deep level three times the base width,
# not twice as in SDXL: at twice, the level above it (4,096 tokens at 128 px) learnt the layout and the deep
# level, skipped, moved the pictures to 22 to 28 dB; at three times to 14 to 16 on seed 0, but 21.5 and 25.6 on
# seeds 1 and 2, until the curriculum below.
PROMPTED_WIDTHS: dict[str, tuple[int, ...] | None] = {"sd15": None, "sdxl": (1, 1, 3)}
# Their curriculum (``TrainConfig.deep_first``, ``TrainConfig.first_levels``): for the first stage (three
# quarters of the first size's steps for SD 1.5, half for SDXL) SD 1.5 trains only its middle block's transformer and its 4,096-token level's (the two levels
# between held), SDXL only its deep level. Trained all at once, SD 1.5's middle block, skipped, moved the
# pictures to 26 to 29 dB only, SDXL's deep level to 21.5 and 25.6 on two seeds of three; the deepest level alone
# for the whole first stage took the work from the levels that joined after it (SD 1.5's 4,096-token level 27 to
# 33 dB, SDXL's 22.7 and 25.7); both ends for the whole stage left SD 1.5's two levels between at 16.5 to 22.5.
# Half the stage: SDXL's two levels at 17.9 dB or less on three seeds, every SD 1.5 level at 18.7 or less on two
# seeds of three, the third's middle block at 22.4 and, trained again on another machine, 30.6 (Euler). SD 1.5's
# three quarters of it: its middle block at 19.2 dB or less on four seeds, every level within the bar on three
# (docs/proxy.md#prompted-proxies).
PROMPTED_CURRICULUM: dict[str, tuple[int, str]] = {"sd15": (1, "ends"), "sdxl": (1, "deepest")}


class PromptEncoder(nn.Module):
    """A prompted proxy's text encoder: each of a prompt's ``scenes.PROMPT_WORDS`` words embedded by a learned
    table, plus a learned vector per slot, so "red" as the first shape's colour and as the second's differ.

    ``forward(tokens (B, PROMPT_WORDS) int64) -> context (B, PROMPT_WORDS, CONTEXT_DIM)``.
    """

    def __init__(self, vocab: tuple[str, ...]) -> None:
        from .scenes import COLOURS, PLACES, PROMPT_WORDS, SHAPES

        super().__init__()
        self.vocab = tuple(vocab)
        # The words that name no colour, shape or place: the backgrounds a prompt can name.
        self.backgrounds = tuple(w for w in self.vocab[1:] if w not in COLOURS and w not in SHAPES
                                 and w not in PLACES)
        self.words = nn.Parameter(torch.zeros(len(vocab), CONTEXT_DIM))
        self.slots = nn.Parameter(torch.zeros(PROMPT_WORDS, CONTEXT_DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.words[tokens] + self.slots

    def encode(self, text: str) -> torch.Tensor:
        """``text`` (``scenes.Scene.text``'s form; "" the empty prompt) -> context (1, PROMPT_WORDS, CONTEXT_DIM).
        ValueError (one line) for a prompt it cannot read."""
        from . import scenes

        with torch.no_grad():
            return self(scenes.tokens(scenes.parse(text, self.backgrounds), self.vocab)[None])


def layout_of(metadata: dict[str, str]) -> ProxyLayout:
    """The layout a weight file's metadata names ("layout"; files from before SDXL's layout: SD 1.5's)."""
    name = metadata.get("layout", "sd15")
    if name not in LAYOUTS:
        raise ValueError(f"unknown proxy layout {name!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def arch_with_widths(layout: str, channel_mult: tuple[int, ...] | None = None) -> dict:
    """``layout``'s ldm arguments with its levels' widths (``channel_mult``, one factor a level) changed: a
    proxy's widths are its own to choose, its levels (which hold attention, how deep, how many tokens) are the
    layout's. None: the layout's own widths."""
    arch = dict(LAYOUTS[layout].arch)
    if channel_mult is not None:
        if len(channel_mult) != len(arch["channel_mult"]) or min(channel_mult) < 1:
            raise ValueError(f"channel_mult {list(channel_mult)}: the {layout} layout has "
                             f"{len(arch['channel_mult'])} levels, each a positive width factor")
        arch["channel_mult"] = [int(m) for m in channel_mult]
    return arch


def build_proxy_unet(seed: int = 0, layout: str = "sd15", channel_mult: tuple[int, ...] | None = None) -> nn.Module:
    """A freshly initialised proxy U-Net of ``layout`` (float32, CPU), its weights drawn from ``seed``, its
    levels' widths ``channel_mult`` (None: the layout's).

    Takes x (B, 3, h, w) with h, w multiples of 8 (SDXL's layout: 4), timesteps (B,) and context (B, T, 32);
    returns (B, 3, h, w).
    """
    require_ldm()
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    spec = LAYOUTS[layout]
    # ldm's layers draw their initial weights from the global generator: seed it, leaving the caller's state
    # as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNetModel(**arch_with_widths(layout, channel_mult))
    if spec.depths is not None:
        trim_depths(unet, spec.depths)
        # ldm's SpatialTransformer takes one context per block: a deep stack needs them as a list.
        unet.register_forward_pre_hook(context_as_list(max(spec.depths.values())), with_kwargs=True)
    return unet


def load_proxy(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               path: str | None = None) -> Pipeline:
    """The shipped proxy as a ``Pipeline``: pixel space (channels 3, downscale 1), epsilon prediction, SD's
    schedule, its learned empty-prompt context (1, 4, 32), and ``decode`` mapping (B, 3, h, w) in [-1, 1] to
    [0, 1]. The U-Net runs as the webui runs ldm (SDP attention), in eval mode and without gradients, on
    ``device`` in ``dtype``.

    Reads ``path`` (default: ``WEIGHTS_FILE``, the first shipped proxy); raises FileNotFoundError (one line)
    when the file is missing: for a shipped file where no weights are installed (a pip-installed library),
    where they are instead (``NOT_INSTALLED``); else the command that makes it.
    """
    path = path or WEIGHTS_FILE
    if not os.path.isfile(path):
        if is_shipped(path) and not os.path.isdir(WEIGHTS_DIR):
            raise FileNotFoundError(NOT_INSTALLED)
        raise FileNotFoundError(f"the proxy model's weights are missing: {path}. They ship with this extension; "
                                f"restore the file (git checkout -- {REPOSITORY_WEIGHTS_DIR}/"
                                f"{os.path.basename(path)}) or train it again: {train_command(path)}")
    from safetensors.torch import load_file

    metadata = read_metadata(path)
    channel_mult = check_arch(path, metadata)
    spec = layout_of(metadata)
    use_webui_unet()
    state = {k: v.float() for k, v in load_file(path).items()}
    encoder = prompt_encoder(metadata, state)
    context = state.pop("context") if encoder is None else encoder.encode("")
    unet = build_proxy_unet(0, spec.name, channel_mult)
    unet.load_state_dict(state)
    unet = in_run_dtype(unet, torch.device(device), dtype).requires_grad_(False)
    # The SD 1.5-layout proxy is "proxy" in the tables, as it was before the SDXL layout existed.
    trained_on = "photographs" if encoder is None else "prompted scenes"
    name = (f"proxy (pixel-space SD 1.x-layout U-Net trained on {trained_on})" if spec.name == "sd15" else
            f"SDXL-layout proxy (pixel-space U-Net with SDXL's levels, trained on {trained_on})")
    encode = None if encoder is None else (lambda text: encoder.encode(text).to(device, dtype))
    return Pipeline(name=name, unet=unet,
                    context=context.to(device, dtype), prediction="eps", channels=3, downscale=1,
                    decode=lambda x: ((x.float() + 1) / 2).clamp(0, 1),
                    notes=["shipped proxy model: ranks methods, not an FID"], size=spec.eval_size,
                    encode_prompt=encode, prompts=() if encoder is None else BENCHMARK_PROMPTS)


# What the benchmark's images are asked for, one prompt an image in turn: each names shapes in different places
# and colours, so a method that loses the prompt or the layout moves the picture.
BENCHMARK_PROMPTS = (
    "a red disc on the left and a blue square on the right, on grass",
    "a yellow triangle at the top, on brick",
    "a white ring in the centre, on hubble_deep_field",
    "a green square at the bottom and a purple disc at the top, on coffee",
    "a black triangle on the right, on moon",
    "a cyan disc on the left and an orange ring on the right, on gravel",
)


def prompt_encoder(metadata: dict[str, str], state: dict[str, torch.Tensor]) -> PromptEncoder | None:
    """A prompted proxy's encoder, its weights taken out of ``state`` (``prompt.words``, ``prompt.slots``); None
    for a proxy trained without prompts (its one learned context is ``state["context"]``)."""
    if "prompt.words" not in state:
        return None
    encoder = PromptEncoder(tuple(json.loads(metadata["vocabulary"])))
    encoder.load_state_dict({"words": state.pop("prompt.words"), "slots": state.pop("prompt.slots")})
    return encoder.requires_grad_(False)


MAKE_ONE = "make one with: python -m tome_core.bench.proxy train --seed N --out proxy-seedN.safetensors"


def read_metadata(path: str) -> dict[str, str]:
    """The safetensors header's metadata of ``path``; ValueError (one line) when the file is not a safetensors
    file at all."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as error:  # safetensors' own SafetensorError (HeaderTooLarge, ...), or an OSError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: not a safetensors file ({reason}); a proxy's weights are a .safetensors file "
                         f"that {MAKE_ONE}") from None


def check_arch(path: str, metadata: dict[str, str]) -> tuple[int, ...] | None:
    """ValueError (one line) unless ``metadata`` names this code's proxy architecture, up to its levels' widths:
    which settings differ, not the whole architecture. Returns the file's widths where they are not the
    layout's (``channel_mult``), else None."""
    try:
        arch = json.loads(metadata.get("arch", "null"))
    except ValueError:
        arch = None
    expected = layout_of(metadata).arch
    if arch == expected:
        return None
    widths = arch.get("channel_mult") if isinstance(arch, dict) else None
    if (isinstance(widths, list) and len(widths) == len(expected["channel_mult"])
            and all(isinstance(m, int) and m >= 1 for m in widths)
            and {**arch, "channel_mult": expected["channel_mult"]} == expected):
        return tuple(widths)
    if not isinstance(arch, dict):
        raise ValueError(f"{path}: a safetensors file, but not a proxy model's weights (no proxy architecture "
                         f"in its metadata); {MAKE_ONE}")
    differ = [f"{k} {arch.get(k, '(none)')} where this code builds {expected[k]}" for k in expected
              if arch.get(k) != expected[k]] + [f"{k} (unknown here)" for k in arch if k not in expected]
    shown = "; ".join(differ[:2]) + (f"; and {len(differ) - 2} more" if len(differ) > 2 else "")
    raise ValueError(f"{path}: a proxy of another architecture ({shown}); {MAKE_ONE}")


def is_shipped(path: str) -> bool:
    """Whether ``path`` names one of the shipped proxies' weight files."""
    return os.path.abspath(path) in {os.path.abspath(p) for p in all_shipped()}


def all_shipped() -> tuple[str, ...]:
    """Every shipped proxy's weight file, each layout's and the prompted ones."""
    return SHIPPED_WEIGHTS + SHIPPED_SDXL_WEIGHTS + SHIPPED_PROMPTED_WEIGHTS + SHIPPED_PROMPTED_SDXL_WEIGHTS


def describe(path: str | None) -> str:
    """What the tables call a proxy: "seed N" from its metadata (made by ``train``), else its file name."""
    path = path or WEIGHTS_FILE
    try:
        seed = read_metadata(path).get("seed")
    except ValueError:
        seed = None
    name = f"seed {seed}" if seed is not None else os.path.basename(path)
    return name if is_shipped(path) or seed is None else f"{name} ({os.path.basename(path)})"
