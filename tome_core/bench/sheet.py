"""The side-by-side picture of a fidelity run: one row per method, one column per setting, the unmerged image
first in every row, each tile captioned, so the eye can judge what the PSNR and SSIM figures say; under each
method's row its differences from the unmerged image, amplified by one gain for the whole sheet (at 40 dB and
above no eye sees a difference in the pictures themselves)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PAD = 6
LABEL_WIDTH = 90  # the method's name at the left of its row
LINE = 13  # px per caption line
CAPTION = 3 * LINE + 4  # three caption lines under each tile
TITLE = 18
MIN_TILE, MAX_TILE = 160, 320


@dataclass(frozen=True)
class Tile:
    """One image (3, H, W) in [0, 1] and its caption lines."""

    image: torch.Tensor
    caption: tuple[str, ...]


def tile_side(image_side: int) -> int:
    """Pixels per tile: small images (the proxy's 64 px) enlarged by a whole factor, so their pixels stay sharp
    squares; large ones shrunk to fit a screen."""
    if image_side < MIN_TILE:
        return image_side * -(-MIN_TILE // image_side)
    return min(image_side, MAX_TILE)


def sheet_size(rows: int, columns: int, tile: int) -> tuple[int, int]:
    """(width, height) in pixels of a sheet of ``rows`` × ``columns`` tiles of ``tile`` px."""
    width = LABEL_WIDTH + columns * (tile + PAD) + PAD
    height = TITLE + rows * (tile + CAPTION + PAD) + PAD
    return width, height


def to_pil(image: torch.Tensor, side: int):
    """(3, H, W) (or (1, H, W)) in [0, 1] -> a Pillow RGB image ``side`` px wide (aspect kept)."""
    from PIL import Image

    img = image.detach().float().cpu().clamp(0, 1)
    if img.shape[0] == 1:
        img = img.expand(3, -1, -1)
    array = (img[:3] * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
    pil = Image.fromarray(array, "RGB")
    h, w = array.shape[:2]
    resample = Image.NEAREST if side >= w else Image.LANCZOS
    return pil.resize((side, max(1, round(h * side / w))), resample)


def write_sheet(path: str, title: str, rows: list[tuple[str, list[Tile]]]) -> tuple[int, int]:
    """Write the PNG: ``rows`` of (method label, tiles), the first tile of each row the unmerged image.
    Returns the sheet's (width, height)."""
    from PIL import Image, ImageDraw, ImageFont

    columns = max(len(tiles) for _, tiles in rows)
    first = rows[0][1][0].image
    tile = tile_side(max(first.shape[-2:]))
    width, height = sheet_size(len(rows), columns, tile)
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    draw.text((PAD, 3), title, fill="black", font=font)
    for r, (label, tiles) in enumerate(rows):
        top = TITLE + r * (tile + CAPTION + PAD)
        draw.text((PAD, top + tile // 2 - 6), label, fill="black", font=font)
        for c, item in enumerate(tiles):
            left = LABEL_WIDTH + PAD + c * (tile + PAD)
            sheet.paste(to_pil(item.image, tile), (left, top))
            for k, line in enumerate(item.caption[:3]):
                draw.text((left, top + tile + 2 + LINE * k), line, fill="black", font=font)
    sheet.save(path)
    return width, height


def difference_gain(images: list[torch.Tensor], reference: torch.Tensor, quantile: float = 0.999) -> float:
    """One gain for every difference map of a sheet: a round number (1, 2 or 5 times a power of ten) at most
    1 / the ``quantile`` of every |image − reference| value, so the largest differences (all but the few
    brightest pixels) just reach white and smaller ones stay comparable across tiles; 1 when nothing moved."""
    if not images:
        return 1.0
    diffs = torch.cat([(img.float() - reference.float()).abs().flatten() for img in images])
    top = float(torch.quantile(diffs[:2 ** 24], quantile)) if diffs.numel() else 0.0
    if top <= 0:
        top = float(diffs.max()) if diffs.numel() else 0.0
    if top <= 0:
        return 1.0
    wanted = 1.0 / top
    power = 10.0 ** math.floor(math.log10(wanted))
    return max(1.0, max(m * power for m in (1, 2, 5) if m * power <= wanted * (1 + 1e-9)))


def difference_map(image: torch.Tensor, reference: torch.Tensor, gain: float) -> torch.Tensor:
    """(3, H, W) in [0, 1]: the largest |difference| over the channels at each pixel, times ``gain``, grey."""
    d = (image.float() - reference.float()).abs().amax(0, keepdim=True) * gain
    return d.clamp(0, 1).expand(3, -1, -1)


def case_rows(case, pictures, fidelity=None) -> list[tuple[str, list[Tile]]]:
    """The sheet's rows for one measured case (``report.Case``) and its ``fidelity.Pictures``: a row per method
    in the case's order, the unmerged image first, each tile captioned with its setting and speed-up, its PSNR
    and SSIM, and its step dB (from ``fidelity``, by contender name, default the case's); under each, the
    row of its amplified differences. The first image of a multi-image run is shown."""
    from .report import figure_cell

    fidelity = case.fidelity if fidelity is None else fidelity
    ref = pictures.images["none"][0]
    reference = Tile(ref, ("no merging", "reference", ""))
    methods = [m for m in dict.fromkeys(e.method for e in case.entries) if m not in ("none", "ideal")]
    shown = {m: [e for e in case.entries if e.method == m and e.name in pictures.images] for m in methods}
    gain = difference_gain([pictures.images[e.name][0] for m in methods for e in shown[m]], ref)
    rows = []
    for method in methods:
        tiles, maps = [reference], [Tile(torch.zeros_like(ref), (f"|diff| x{gain:g}", "black: no change", ""))]
        for entry in shown[method]:
            fid = (fidelity or {}).get(entry.name)
            speed = case.speedup(entry.name)
            first = f"{entry.setting}" + (f"  {speed:.2f}x" if speed is not None else "")
            second = "" if fid is None else f"{figure_cell(fid.psnr)} dB  SSIM {fid.ssim:.3f}"
            third = "" if fid is None or fid.step is None else f"step {figure_cell(fid.step)} dB"
            image = pictures.images[entry.name][0]
            tiles.append(Tile(image, (first, second, third)))
            maps.append(Tile(difference_map(image, ref, gain), (entry.setting, "", "")))
        rows.append((method, tiles))
        rows.append((f"{method} |diff|", maps))
    return rows


def write_case_sheet(path: str, case, pictures, title: str, fidelity=None) -> tuple[int, int]:
    """``write_sheet`` of ``case_rows(case, pictures, fidelity)``."""
    return write_sheet(path, title, case_rows(case, pictures, fidelity))
