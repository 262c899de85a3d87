"""Scenes a prompt describes: what the prompted proxies are trained on and sampled with.

A scene is one or two large shapes (what, which colour, where) on a photograph's texture (which one), and its
prompt names each of those. A shape's place and size are a good part of the picture's side, so drawing it in
the right place, whole and in one colour, needs the U-Net's deep, coarse levels, and the prompt decides the
picture's layout as a user's prompt does: a model that ignores its deep level or its prompt cannot draw these.

A prompt is a fixed number of words (``PROMPT_WORDS``), each from its own list, written as a sentence
("a red disc on the left and a blue ring at the top, on grass"); the empty prompt (every word "", index 0) is
classifier-free guidance's unconditional half and what training drops a prompt to now and then.

Everything random comes from the caller's generator, so training repeats bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Each list's first entry, "", is "not said" (the empty prompt, or no second shape).
SHAPES = ("", "disc", "square", "triangle", "ring")
COLOURS = {"": (0.0, 0.0, 0.0), "red": (0.85, -0.75, -0.75), "orange": (0.95, 0.15, -0.85),
           "yellow": (0.9, 0.85, -0.8), "green": (-0.7, 0.6, -0.7), "cyan": (-0.8, 0.7, 0.85),
           "blue": (-0.75, -0.45, 0.85), "purple": (0.4, -0.7, 0.7), "white": (0.95, 0.95, 0.95),
           "black": (-0.95, -0.95, -0.95)}
# Where a shape's centre lies, as fractions of the side (x, y); two shapes take two different places.
PLACES = {"": (0.5, 0.5), "left": (0.3, 0.5), "right": (0.7, 0.5), "top": (0.5, 0.3), "bottom": (0.5, 0.7),
          "centre": (0.5, 0.5)}
PLACE_PHRASES = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom",
                 "centre": "in the centre"}

# One word a slot: the background, then (colour, shape, place) of the first and of the second shape.
SLOTS = ("background", "colour", "shape", "place", "colour", "shape", "place")
PROMPT_WORDS = len(SLOTS)


def vocabulary(backgrounds: tuple[str, ...]) -> tuple[str, ...]:
    """Every word a prompt can hold, "" first: the index a prompt's words are embedded by."""
    words = [""] + list(backgrounds) + [c for c in COLOURS if c] + [s for s in SHAPES if s] + \
        [p for p in PLACES if p]
    return tuple(words)


@dataclass(frozen=True)
class Scene:
    """What a prompt says: a background's name and one or two (colour, shape, place) shapes."""

    background: str
    shapes: tuple[tuple[str, str, str], ...]

    @property
    def words(self) -> tuple[str, ...]:
        """The prompt's words, one a slot (``SLOTS``), "" where it says nothing."""
        out = [self.background]
        for colour, shape, place in self.shapes + (("", "", ""),) * (2 - len(self.shapes)):
            out += [colour, shape, place]
        return tuple(out)

    @property
    def text(self) -> str:
        """The prompt as a sentence, as a user would write it ("" for the empty prompt)."""
        parts = [f"{'an' if c[0] in 'aeiou' else 'a'} {c} {s} {PLACE_PHRASES[p]}" for c, s, p in self.shapes]
        said = " and ".join(parts)
        if self.background:
            said = f"{said}, on {self.background}" if said else self.background
        return said


EMPTY = Scene("", ())


def parse(text: str, backgrounds: tuple[str, ...]) -> Scene:
    """The scene a sentence of ``Scene.text``'s form says; ValueError (one line) for one it cannot read."""
    text = text.strip()
    if not text:
        return EMPTY
    body, _, background = text.rpartition(", on ")
    if not body:
        body, background = text, ""
        if text in backgrounds:
            return Scene(text, ())
    if background and background not in backgrounds:
        raise ValueError(f"unknown background {background!r} in prompt {text!r}; known: {', '.join(backgrounds)}")
    shapes = []
    for part in body.split(" and "):
        words = part.split(" ", 3)
        phrase = {v: k for k, v in PLACE_PHRASES.items()}.get(words[3] if len(words) == 4 else "")
        if len(words) != 4 or words[0] not in ("a", "an") or words[1] not in COLOURS or words[2] not in SHAPES or not phrase:
            raise ValueError(f"cannot read {part!r} in prompt {text!r}: write 'a COLOUR SHAPE PLACE' with a colour "
                             f"of {', '.join(c for c in COLOURS if c)}, a shape of {', '.join(s for s in SHAPES if s)}"
                             f" and a place of {', '.join(PLACE_PHRASES.values())}")
        shapes.append((words[1], words[2], phrase))
    if len(shapes) > 2:
        raise ValueError(f"a prompt names at most two shapes, got {len(shapes)} in {text!r}")
    return Scene(background, tuple(shapes))


def tokens(scene: Scene, vocab: tuple[str, ...]) -> torch.Tensor:
    """(PROMPT_WORDS,) int64 indices of the scene's words in ``vocab``."""
    index = {w: i for i, w in enumerate(vocab)}
    return torch.tensor([index[w] for w in scene.words], dtype=torch.long)


_OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


def random_scene(backgrounds: tuple[str, ...], gen: torch.Generator) -> Scene:
    """A scene drawn from ``gen``: any background, one shape or (half the time) two in different places."""
    u = torch.randint(0, 1 << 30, (8,), generator=gen).tolist()
    colours = [c for c in COLOURS if c]
    shapes = [s for s in SHAPES if s]
    places = [p for p in PLACES if p]
    first = (colours[u[1] % len(colours)], shapes[u[2] % len(shapes)], places[u[3] % len(places)])
    scene = [first]
    if u[4] % 2:
        # The second shape goes opposite the first (centre: anywhere else), so the two rarely overlap much.
        place = _OPPOSITE.get(first[2]) or places[u[5] % 4]
        scene.append((colours[u[6] % len(colours)], shapes[u[7] % len(shapes)], place))
    return Scene(backgrounds[u[0] % len(backgrounds)], tuple(scene))


def shape_mask(shape: str, size: int, centre: tuple[float, float], radius: float) -> torch.Tensor:
    """(size, size) coverage in [0, 1] of ``shape`` centred at ``centre`` (px) with ``radius`` (px),
    antialiased over about a pixel."""
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    y, x = torch.meshgrid(coords - centre[1], coords - centre[0], indexing="ij")
    if shape == "disc":
        inside = radius - (x * x + y * y).sqrt()
    elif shape == "ring":
        distance = (x * x + y * y).sqrt()
        inside = torch.minimum(radius - distance, distance - 0.55 * radius)
    elif shape == "square":
        inside = 0.85 * radius - torch.maximum(x.abs(), y.abs())
    elif shape == "triangle":  # pointing up, its three edges' inward distances
        r = radius
        edges = [(0.0, 1.0, 0.5 * r)] + [(s * math.sqrt(3) / 2, -0.5, 0.5 * r) for s in (1.0, -1.0)]
        inside = torch.stack([c - (a * x + b * y) for a, b, c in edges]).amin(0)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return (inside + 0.5).clamp(0, 1)


def render(scene: Scene, background: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """The scene's picture (3, size, size) in [-1, 1] on ``background`` (3, size, size), a crop of the
    background's photograph: its contrast halved so the shapes stand out, each shape filled with its colour,
    shaded by a light from the top left and lightly textured by the background, its place and size jittered by
    ``gen``."""
    image = background * 0.5
    u = torch.rand(len(scene.shapes), 4, generator=gen)
    coords = torch.linspace(-1, 1, size)
    light = (-(coords[None, :] + coords[:, None]) * 0.12)[None]  # brighter to the top left
    for k, (colour, shape, place) in enumerate(scene.shapes):
        cx, cy = PLACES[place]
        centre = ((cx + (float(u[k, 0]) - 0.5) * 0.12) * size, (cy + (float(u[k, 1]) - 0.5) * 0.12) * size)
        radius = (0.17 + 0.08 * float(u[k, 2])) * size
        mask = shape_mask(shape, size, centre, radius)[None]
        fill = torch.tensor(COLOURS[colour]).view(3, 1, 1) + light + 0.15 * background.mean(0, keepdim=True)
        image = image * (1 - mask) + fill.clamp(-1, 1) * mask
    return image.clamp(-1, 1)


def scene_batch(pyramids: list[list[torch.Tensor]], backgrounds: tuple[str, ...], count: int, size: int,
                gen: torch.Generator, crops) -> tuple[torch.Tensor, list[Scene]]:
    """``count`` random scenes: pictures (count, 3, size, size) in [-1, 1] and what their prompts say.
    ``pyramids[i]`` is ``backgrounds[i]``'s photograph as a pyramid; ``crops(pyramids, count, size, gen)`` cuts
    the backgrounds (``training.random_crops``)."""
    scenes = [random_scene(backgrounds, gen) for _ in range(count)]
    images = []
    for scene in scenes:
        back = crops([pyramids[backgrounds.index(scene.background)]], 1, size, gen)[0]
        images.append(render(scene, back, size, gen))
    return torch.stack(images), scenes


def drop_prompts(count: int, probability: float, gen: torch.Generator) -> list[bool]:
    """Which of ``count`` prompts training replaces by the empty one (classifier-free guidance's training)."""
    return (torch.rand(count, generator=gen) < probability).tolist()
