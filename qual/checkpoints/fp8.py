"""FP8 block-quantized checkpoints (DeepSeek-V3 / GLM family; transformers' FineGrainedFP8, vLLM's `fp8` method).

config.json carries `quantization_config: {quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
weight_block_size: [bo, bi]}` (top level, or inside text_config). A quantized linear weight W [out, in] is stored
as float8_e4m3fn beside `<name>_scale_inv` [ceil(out/bo), ceil(in/bi)] (float32), and the real weight is
W8[i, j] * scale_inv[i // bo, j // bi]: the name says "inv", the tensor multiplies. Tensors without a scale
(embeddings, norms, the router, whatever `modules_to_not_convert` lists) are stored in their own dtype.

Dequantization here is the product computed in at least float32 (float64 for a float64 run: exact, since e4m3
has a 4-bit significand) and rounded once to the run's dtype: what transformers and vLLM's loaders compute for
bfloat16. Activations stay in the run's dtype: vLLM's FP8 GEMMs also quantize activations per 128-wide group
(activation_scheme dynamic), which this does not model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qual.errors import QualError

if TYPE_CHECKING:  # torch is imported where tensors are made: the plan reads SCALE_SUFFIX without it
    import torch

SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers"}


@dataclass(frozen=True, slots=True)
class BlockFp8:
    """A checkpoint's FP8 block quantization: the block of one scale, and the modules stored unquantized."""

    block: tuple[int, int]  # (rows, columns) of the weight one scale covers
    unquantized: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers (module name prefixes)


def parse_quantization(raw, where: str) -> BlockFp8 | None:
    """A config.json's quantization_config (None when absent); any other method or form is refused by name."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QualError(f"{where}: quantization_config must be an object")
    method = raw.get("quant_method")
    if method != "fp8":
        raise QualError(f"{where}: quantization_config.quant_method {method!r} is not implemented (FP8 with block "
                        f"scales only: quant_method fp8)")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise QualError(f"{where}: quantization_config.{unknown[0]} is not implemented")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise QualError(f"{where}: quantization_config.fmt {raw['fmt']!r} is not implemented (e4m3 only)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise QualError(f"{where}: quantization_config.activation_scheme {raw['activation_scheme']!r} is not "
                        f"implemented (dynamic only: static activation scales are not read)")
    block = raw.get("weight_block_size")
    if block is None:
        raise QualError(f"{where}: quantization_config without weight_block_size (per-tensor FP8 scales) is not "
                        f"implemented (block scales only)")
    if (not isinstance(block, list) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise QualError(f"{where}: quantization_config.weight_block_size must be two positive integers (got {block!r})")
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise QualError(f"{where}: quantization_config.modules_to_not_convert must be a list of module names")
    return BlockFp8((block[0], block[1]), tuple(skip))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out/bo), ceil(in/bi)]: one scale per block, partial blocks at the edges included."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """W8 [..., out, in] * scale_inv [..., ceil(out/bo), ceil(in/bi)] expanded over its blocks, computed in at least
    float32 and rounded once to `dtype`."""
    import torch

    acc = torch.promote_types(dtype, torch.float32)
    rows, cols = weight.shape[-2:]
    s = scale.to(acc).repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return (weight.to(acc) * s).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 float8_e4m3fn, scale_inv float32) of a float weight [out, in]: each block scaled so its largest magnitude
    maps to e4m3's largest finite value (how FP8 checkpoints are made; the tests write them with it)."""
    import torch

    rows, cols = weight.shape
    sr, sc = scale_shape(weight.shape, block)
    padded = torch.zeros(sr * block[0], sc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(sr, block[0], sc, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [sr, sc]
    scale = amax / E4M3_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(sr * block[0], sc * block[1])
    return q[:rows, :cols].contiguous(), scale
