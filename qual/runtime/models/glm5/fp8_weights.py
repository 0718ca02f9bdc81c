"""FP8 weights of a GLM-5.3-Flash checkpoint as vLLM 0.32 loads them: which tensors it keeps FP8, dequantizes on load
or cannot load (fp8_load_path), the block alignment it checks, and this rank's FP8 slices the loader (weights.py) keeps
(the routed experts always; the dense and shared MLPs and the indexer's wq_b under vLLM's numerics). `ctx` is the
loader's per-checkpoint context (weights._Load): its reader, config, rank, TP size and numerics."""

from __future__ import annotations

import re

import torch

from qual.errors import QualError
from qual.runtime.models.glm5.moe import Fp8Experts, MlpWeights
from qual.runtime.models.glm5.numerics import Fp8Weight, deep_gemm_takes, requant_ue8m0

# Where vLLM 0.32's glm5next puts an FP8 block-quantized tensor of the checkpoint (common/model.py): layers built with
# the FP8 quant_config keep it FP8 (the MLPs, Glm5NextMLP and the shared experts; the routed experts, FusedMoE; the
# indexer's wq_b, a ReplicatedLinear); _try_load_fp8_attn_proj and _try_load_fp8_indexer_wk dequantize MLA's
# q_a/kv_a/q_b projections, every o_proj and the indexer's wk to bfloat16. Anything else (KDA's projections, kv_b_proj,
# weights_proj, the compress gate, embeddings, router) has no FP8 load path there.
FP8_KEPT, FP8_DEQUANTIZED = "kept", "dequantized"
# an MLP's projections: dense, shared experts, each routed expert
MLP_WEIGHT = re.compile(r"\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight$")
_FP8_PATHS = (
    (MLP_WEIGHT, FP8_KEPT),
    (re.compile(r"\.self_attn\.indexer\.wq_b\.weight$"), FP8_KEPT),
    (re.compile(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|o_proj)\.weight$"), FP8_DEQUANTIZED),
    (re.compile(r"\.self_attn\.indexer\.wk\.weight$"), FP8_DEQUANTIZED),
)


def fp8_load_path(name: str) -> str | None:
    """How vLLM loads a tensor stored FP8: FP8_KEPT, FP8_DEQUANTIZED, or None (it cannot)."""
    return next((kind for pattern, kind in _FP8_PATHS if pattern.search(name)), None)


def fp8_weight(ctx, q: torch.Tensor, scale: torch.Tensor, merged_rows: int | None = None) -> Fp8Weight:
    """This rank's FP8 weight as vLLM keeps it; where DeepGEMM serves it (numerics vllm-hopper), requantized to
    power-of-two scales with power-of-two activation scales. merged_rows: the rows of the GEMM it is part of (gate and
    up run as one)."""
    block = ctx.cfg.quantization.block
    deep = ctx.numerics.deep_gemm and deep_gemm_takes(merged_rows or q.shape[0], q.shape[1])
    if deep:
        q, scale = requant_ue8m0(q, scale, block)
    return Fp8Weight(ctx.cast(q, torch.float8_e4m3fn), ctx.cast(scale, torch.float32), block, act_ue8m0=deep)


def kept_fp8(ctx, name: str, shape: tuple[int, int], merged_rows: int | None = None) -> Fp8Weight | None:
    """A replicated weight vLLM keeps FP8, as an Fp8Weight where the numerics keep it so (None: read it plainly)."""
    if not (ctx.numerics.fp8_activations and ctx.rd.is_fp8(name)):
        return None
    return fp8_weight(ctx, *ctx.rd.get_fp8(name, shape), merged_rows)


def check_mlp_blocks(ctx, inter: int, part: int, key: str) -> None:
    """vLLM's validate_fp8_block_shape for an FP8 MLP: gate and up run as one merged GEMM, so gate's rows fill
    whole blocks at every TP; split for TP, each rank's gate and up rows and down columns fill whole blocks."""
    cfg, (bo, bi) = ctx.cfg, ctx.cfg.quantization.block
    checks = [("gate_proj rows", part if ctx.tp > 1 else inter, bo)]
    if ctx.tp > 1:
        checks += [("down_proj columns", part, bi)]
    for what, size, block in checks:
        if size % block:
            raise QualError(f"{cfg.source}: {key}={inter} at tp={ctx.tp} gives {size} FP8 {what} a rank, not a "
                            f"multiple of the weight_block_size {block} (vLLM refuses it)")


def fp8_mlp(ctx, p: str, inter: int, part: int) -> MlpWeights:
    """This rank's slice of an FP8 MLP kept FP8 (whole blocks: check_mlp_blocks)."""
    hid, (bo, bi), rank = ctx.cfg.hidden_size, ctx.cfg.quantization.block, ctx.rank
    out = []
    for proj, shape in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
        q, s = ctx.rd.get_fp8(f"{p}{proj}.weight", shape)
        if proj == "down_proj":
            q, s = q[:, rank * part:(rank + 1) * part], s[:, rank * part // bi:rank * part // bi + -(-part // bi)]
            out.append(fp8_weight(ctx, q, s))
        else:
            q, s = q[rank * part:(rank + 1) * part], s[rank * part // bo:rank * part // bo + -(-part // bo)]
            out.append(fp8_weight(ctx, q, s, merged_rows=2 * part))
    return MlpWeights(*out)


def fp8_experts(ctx, p: str, part: int) -> tuple[Fp8Experts, Fp8Experts, Fp8Experts]:
    """The routed experts' gate, up and down projections kept in FP8, this rank's `part` of the intermediate
    dimension of each: the slice must cover whole scale blocks (vLLM refuses it otherwise too)."""
    rd, cfg, rank, tp, cast = ctx.rd, ctx.cfg, ctx.rank, ctx.tp, ctx.cast
    E, hid, inter, (bo, bi) = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.quantization.block
    # vLLM's validate_fp8_block_shape_moe: the merged gate/up rows fill whole blocks at every TP, 1 included; down's
    # columns only where TP splits them
    for what, size, block in (("gate_proj and up_proj rows", part, bo), ("down_proj columns", part, bi)):
        if (tp > 1 or what != "down_proj columns") and size % block:
            raise QualError(f"{cfg.source}: moe_intermediate_size={inter} at tp={tp} gives each rank {size} {what}, "
                            f"not a multiple of the FP8 weight_block_size {block}")
    out = []
    for proj, shape in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
        block = bi if proj == "down_proj" else bo  # the intermediate dim: columns of down, rows of gate and up
        own, scales = slice(rank * part, (rank + 1) * part), slice(rank * part // block, rank * part // block + -(-part // block))
        qs, ss = [], []
        for e in range(E):
            got = rd.get_fp8(f"{p}experts.{e}.{proj}.weight", shape)
            if got is None:
                raise QualError(f"checkpoint {rd.path}: expert {e}'s {proj} has no FP8 scales while expert 0's has "
                                f"(the routed experts are quantized alike)")
            q, s = got
            qs.append(q[:, own] if proj == "down_proj" else q[own])
            ss.append(s[:, scales] if proj == "down_proj" else s[scales])
        out.append(Fp8Experts(cast(torch.stack(qs), torch.float8_e4m3fn), cast(torch.stack(ss), torch.float32),
                              cfg.quantization.block, ctx.dtype, fp8_gemm=ctx.numerics.fp8_activations,
                              act_ue8m0=ctx.numerics.deep_gemm))
    return tuple(out)
