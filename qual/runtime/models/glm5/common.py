"""Small helpers shared by the GLM-5 layers."""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the precision-critical islands (states, gates, router, scores): at least float32.

    transformers computes these in float32 for bf16 models; in a float64 model they stay float64.
    """
    return torch.promote_types(dtype, torch.float32)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
