"""The side-by-side picture of a fidelity run: one row per method, one column per setting, the unmerged image
first in every row, each tile captioned, so the eye can judge what the PSNR and SSIM figures say."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 6
LABEL_WIDTH = 90  # the method's name at the left of its row
CAPTION = 30  # two caption lines under each tile
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
            for k, line in enumerate(item.caption[:2]):
                draw.text((left, top + tile + 2 + 13 * k), line, fill="black", font=font)
    sheet.save(path)
    return width, height


def case_rows(case, pictures) -> list[tuple[str, list[Tile]]]:
    """The sheet's rows for one measured case (``report.Case``) and its ``fidelity.Pictures``: a row per method
    in the case's order, the unmerged image first, each tile captioned with its setting, speed-up, PSNR and
    SSIM. The first image of a multi-image run is shown."""
    from .report import psnr_cell

    reference = Tile(pictures.images["none"][0], ("no merging", "reference"))
    methods = [m for m in dict.fromkeys(e.method for e in case.entries) if m not in ("none", "ideal")]
    rows = []
    for method in methods:
        tiles = [reference]
        for entry in (e for e in case.entries if e.method == method and e.name in pictures.images):
            fid = (case.fidelity or {}).get(entry.name)
            speed = case.speedup(entry.name)
            first = f"{entry.setting}" + (f"  {speed:.2f}x" if speed is not None else "")
            second = "" if fid is None else f"{psnr_cell(fid.psnr)} dB  SSIM {fid.ssim:.3f}"
            tiles.append(Tile(pictures.images[entry.name][0], (first, second)))
        rows.append((method, tiles))
    return rows


def write_case_sheet(path: str, case, pictures, title: str) -> tuple[int, int]:
    """``write_sheet`` of ``case_rows(case, pictures)``."""
    return write_sheet(path, title, case_rows(case, pictures))
