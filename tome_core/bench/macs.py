"""Multiply-adds of a call, counted from the shapes of its matrix products, convolutions and attention kernels
(PyTorch's ``FlopCounterMode``): a figure of the work a method removes that does not depend on how busy the
machine is, so the gain a faster device can reach is foreseeable from the CPU.

PyTorch's counter knows the GPU's fused attention kernels but not the CPU's
(``_scaled_dot_product_flash_attention_for_cpu``), which it would count as nothing; its formula is added here:
Q·Kᵀ and the weighted sum, B·H·Nq·Nk·(D + Dv) multiply-adds.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode


def _cpu_flash_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """FLOPs (two per multiply-add, as the counter counts them) of the CPU's fused attention, from the shapes of
    query (B, H, Nq, D), key (B, H, Nk, D) and value (B, H, Nk, Dv)."""
    b, h, nq, d = query
    nk, dv = key[-2], value[-1]
    return 2 * b * h * nq * nk * (d + dv)


def _custom_formulas() -> dict:
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {} if op is None else {op: _cpu_flash_attention_flops}


class MultiplyAddCounter(FlopCounterMode):
    """A context manager counting the multiply-adds dispatched inside it; ``total`` after it closes."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=_custom_formulas())

    @property
    def total(self) -> int:
        return self.get_total_flops() // 2
