"""How far a picture moved: PSNR and SSIM of images in [0, 1], written out here so the benchmark needs nothing
beyond torch.

SSIM follows Wang et al. 2004 as most tools compute it: an 11×11 Gaussian window with σ 1.5, C1 = (0.01·L)²,
C2 = (0.03·L)² with data range L = 1, population (not sample) variances, the map averaged over the positions
where the whole window fits, per channel, then over channels and images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03


def psnr(image: torch.Tensor, reference: torch.Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of the mean squared error over every pixel, ``inf`` when identical.

    image, reference: (B, C, H, W) (or (C, H, W)) in [0, data_range].
    """
    a, b = _batched(image, reference)
    mse = (a - b).pow(2).mean().item()
    return math.inf if mse == 0 else 10.0 * math.log10(data_range ** 2 / mse)


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(size, size) Gaussian weights summing to 1."""
    x = torch.arange(size, dtype=dtype) - (size - 1) / 2
    g = torch.exp(-x ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(image: torch.Tensor, reference: torch.Tensor, data_range: float = 1.0) -> float:
    """Structural similarity, 1 for identical images.

    image, reference: (B, C, H, W) (or (C, H, W)), H and W at least 11, values in [0, data_range].
    """
    a, b = _batched(image, reference)
    n, c, h, w = a.shape
    if h < WINDOW or w < WINDOW:
        raise ValueError(f"SSIM needs images of at least {WINDOW}×{WINDOW} pixels, got {h}×{w}")
    # Each channel of each image on its own: one grouped convolution with the same window.
    a, b = a.reshape(n * c, 1, h, w), b.reshape(n * c, 1, h, w)
    win = gaussian_window(dtype=a.dtype).to(a.device)[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, win)  # no padding: only positions where the whole window fits

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s.reshape(n, c, -1).mean(2).mean().item()


def psnr_each(image: torch.Tensor, reference: torch.Tensor, data_range: float = 1.0) -> list[float]:
    """``psnr`` of each image of a batch (B, C, H, W) against its own reference: B values."""
    a, b = _batched(image, reference)
    return [psnr(a[i], b[i], data_range) for i in range(a.shape[0])]


def ssim_each(image: torch.Tensor, reference: torch.Tensor, data_range: float = 1.0) -> list[float]:
    """``ssim`` of each image of a batch (B, C, H, W) against its own reference: B values."""
    a, b = _batched(image, reference)
    return [ssim(a[i], b[i], data_range) for i in range(a.shape[0])]


def _batched(image: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if image.shape != reference.shape:
        raise ValueError(f"images of different shapes: {tuple(image.shape)} and {tuple(reference.shape)}")
    a, b = image.detach().double().cpu(), reference.detach().double().cpu()
    if a.dim() == 3:
        a, b = a[None], b[None]
    if a.dim() != 4:
        raise ValueError(f"expected (B, C, H, W) or (C, H, W) images, got shape {tuple(image.shape)}")
    return a, b
