"""GLM-5.3-Flash as vLLM 0.32 computes it, where that differs from the model as written (docs/glm5.md, "Numerics").

`exact` is transformers' form: FP8 weights dequantized, activations as they are, the indexer in the run's dtype.
`vllm` follows vLLM's kernels (each function below names the one it follows):
  - the indexer rotates q and every pooled key by the 128-wide Hadamard transform and stores them as FP8 e4m3 with
    a power-of-two scale per 128 values; its head weights are a float32 GEMM;
  - every FP8 GEMM quantizes its input per token in groups of 128 (dynamic, float32 scales);
  - MHC mixes in float32 and rounds once;
  - KDA runs the bounded ("safe") gate always, with lower bound -5.0 where the config gives none.
`vllm-hopper` adds what DeepGEMM changes on H100/H200 (VLLM_USE_DEEP_GEMM_E8M0, on by default): a dense FP8 GEMM
that DeepGEMM takes (its weight N % 64 == 0 and K % 128 == 0) has its weight requantized to power-of-two (UE8M0)
block scales and its activations quantized with power-of-two scales; the routed experts (Triton's fused MoE on
Hopper) keep their weights and take power-of-two activation scales too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qual.checkpoints.fp8 import E4M3_MAX, dequantize
from qual.errors import QualError
from qual.options import NUMERICS

INDEX_DIM = 128  # the width vLLM's indexer kernels rotate and quantize (it asserts index_head_dim == 128)
ACT_GROUP = 128  # activations are quantized per token in groups of this many channels
_ACT_EPS = 1e-10  # per_token_group_fp8_quant: floor of a group's absolute maximum
_INDEX_EPS = 1e-4  # fwht128_quant_fp8 / the kpool compress kernel: floor of a row's absolute maximum
_DEEP_GEMM_N, _DEEP_GEMM_K = 64, 128  # should_use_deepgemm_for_fp8_linear: the shapes DeepGEMM takes


@dataclass(frozen=True)
class Numerics:
    """Which of vLLM's computations a run follows (each flag a piece of docs/glm5.md's table)."""

    name: str
    fp8_indexer: bool = False  # Hadamard-rotated FP8 index queries and pooled keys, float32 head weights
    fp8_activations: bool = False  # FP8 weights stay FP8; their GEMMs quantize the input per token and group
    hc_float32: bool = False  # hc_pre / hc_post as vLLM's mhc_pre / mhc_post: float32 mixes, one rounding
    safe_gate: bool = False  # KDA's bounded gate always (lower bound -5.0 by default)
    deep_gemm: bool = False  # DeepGEMM's power-of-two (UE8M0) scales, weights requantized where it runs


def numerics_of(name: str) -> Numerics:
    """The computations a `numerics` value names (qual.options.NUMERICS)."""
    if name not in NUMERICS:
        raise QualError(f"numerics must be one of {', '.join(NUMERICS)} (got {name!r})")
    if name == NUMERICS[0]:
        return Numerics(name)
    return Numerics(name, fp8_indexer=True, fp8_activations=True, hc_float32=True, safe_gate=True,
                    deep_gemm=name == NUMERICS[2])


def safe_gate_bound(lower_bound: float | None, numerics: Numerics) -> float | None:
    """KDA's forget-gate bound: vLLM runs the safe gate always (`LOWER_BOUND=lower_bound if lower_bound is not None
    else -5.0` in its KDA kernels); transformers runs the softplus form when the config gives none (None here)."""
    if lower_bound is None and numerics.safe_gate:
        return -5.0
    return lower_bound


# -- FP8 quantization ---------------------------------------------------------------------------------------------

def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or above each scale: UE8M0's `exp2(ceil(log2(s)))`."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def group_quant_fp8(x: torch.Tensor, group: int = ACT_GROUP, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization per token in groups of `group` channels (per_token_group_quant_fp8's kernel): per
    group, scale = max(|x|, 1e-10) / 448 (rounded up to a power of two with ue8m0), q = clamp(x / scale, +-448) as
    e4m3. x [..., K] -> (q float8_e4m3fn [..., K], scale float32 [..., ceil(K / group)]); a last partial group is
    quantized over the channels it has."""
    K = x.shape[-1]
    pad = -K % group
    xf = F.pad(x.float(), (0, pad)).unflatten(-1, (-1, group))  # [..., G, group]
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=_ACT_EPS)
    scale = amax * (1.0 / E4M3_MAX)  # the kernel multiplies by the reciprocal (as PyTorch divides by a scalar)
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :K], scale.squeeze(-1)


def expand_groups(scale: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """Per-group scales [..., G] -> per-channel [..., width]."""
    return scale.repeat_interleave(group, -1)[..., :width]


def requant_ue8m0(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's weight preparation (requant_weight_ue8m0_inplace -> per_block_cast_to_fp8(use_ue8m0=True)): the
    weight dequantized in float32 with its old scales, then per block amax (floor 1e-4) / 448 rounded up to a power
    of two, and W8 = (W * (1 / scale)) as e4m3. q [out, in] float8, scale [ceil(out/bo), ceil(in/bi)]."""
    bo, bi = block
    rows, cols = q.shape
    w = dequantize(q, scale, block, torch.float32)
    padded = F.pad(w, (0, -cols % bi, 0, -rows % bo))
    tiles = padded.view(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    sf = pow2_ceil(amax / E4M3_MAX)
    requant = (tiles * (1.0 / sf)).to(torch.float8_e4m3fn).view_as(padded)
    return requant[:rows, :cols].contiguous(), sf.view(tiles.shape[0], tiles.shape[2])


def deep_gemm_takes(rows: int, cols: int) -> bool:
    """Whether vLLM's DeepGEMM block-FP8 linear kernel serves a weight of this rank's shape [N, K] (its dense FP8
    GEMMs elsewhere run CUTLASS with float32 scales)."""
    return rows % _DEEP_GEMM_N == 0 and cols % _DEEP_GEMM_K == 0


@dataclass
class Fp8Weight:
    """One FP8 block-quantized weight kept as vLLM keeps it: its GEMM quantizes the input (per token, groups of
    block[1]) and multiplies both scales in, accumulating in at least float32."""

    q: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [ceil(out/bo), ceil(in/bi)] float32
    block: tuple[int, int]
    act_ue8m0: bool = False  # activation scales rounded up to powers of two (DeepGEMM's E8M0 mode)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.block, dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """W8A8 block-FP8 GEMM (vLLM's Fp8LinearMethod with weight_block_size; the fused MoE's experts alike): x [T, K]
    quantized per token in groups of block[1], both operands' scales applied, accumulated in at least float32 and
    rounded once to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    q, s = group_quant_fp8(x, w.block[1], w.act_ue8m0)
    xq = q.to(acc) * expand_groups(s.to(acc), w.block[1], x.shape[-1])
    return F.linear(xq, w.dequantized(acc)).to(x.dtype)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """A projection by a plain weight (F.linear) or an FP8 one (fp8_linear)."""
    return fp8_linear(x, w) if isinstance(w, Fp8Weight) else F.linear(x, w)


# -- the FP8 indexer ----------------------------------------------------------------------------------------------

def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] rotated by the orthonormal Sylvester-Hadamard matrix: the butterfly stages of vLLM's _hadamard128
    and fast_hadamard_transform (pairs at distance 1, 2, ..., n/2), in x's dtype, then times 1/sqrt(n) (for n = 128
    the kernels' 0.08838834764831845). n a power of two: vLLM's indexer has n = 128; a toy of another width rotates
    at its own."""
    shape, n = x.shape, x.shape[-1]
    if n & (n - 1):
        raise QualError(f"the FP8 indexer's Hadamard rotation needs a power-of-two index_head_dim (vLLM's is "
                        f"{INDEX_DIM}), got {n}")
    h = 1
    while h < n:
        v = x.reshape(*shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(shape)
        h *= 2
    return x * n**-0.5


def rotate_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fwht128_quant_fp8 (and the rotate-and-quantize tail of the kpool compress kernel): each row rotated in float32,
    rounded to bfloat16, then FP8 with one power-of-two scale, 2^ceil(log2(max(|x|, 1e-4) / 448)).
    x [..., Di] -> (q float8_e4m3fn [..., Di], scale float32 [...])."""
    r = hadamard(x.float()).to(torch.bfloat16).float()
    amax = r.abs().amax(-1).clamp(min=_INDEX_EPS)
    scale = pow2_ceil(amax * (1.0 / E4M3_MAX))
    q = (r / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def pool_fp8(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_kpool_softmax_rotate_write_cache_kernel: k, gate [P, kpool, Di] -> per pool and channel the softmax over the
    pool's tokens of (gate + ape) in float32 (max subtracted, exp-weighted sum of k over the sum of weights), rounded
    to bfloat16, then rotate_quant_fp8: (q [P, Di] float8_e4m3fn, scale [P] float32)."""
    score = gate.float() + ape.float()
    prob = torch.exp(score - score.amax(1, keepdim=True))
    pooled = (k.float() * prob).sum(1) / prob.sum(1)
    return rotate_quant_fp8(pooled.to(torch.bfloat16))


def fp8_dequant_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] e4m3 times its row's power-of-two scale [...]: exact in float32 and bfloat16 (e4m3 values carry 4
    significant bits), so the cache can hold an FP8 key in the run's dtype and give back the same value."""
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
