"""transformers' derivations of a GLM-5.3-Flash config's per-layer schedules (layer_types, mlp_layer_types,
indexer_types and their pattern / frequency forms) and of the Kimi-style linear_attn_config dict."""

from __future__ import annotations

from qual.errors import QualError

LINEAR, INDEXED = "linear_attention", "indexed_attention"


def schedule(text: dict, n: int) -> tuple[list, list, list]:
    """layer_types, mlp_layer_types and indexer_types with transformers' defaults and aliases."""
    mlp = text.get("mlp_layer_types")
    if mlp is None:
        mlp = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    layers = text.get("layer_types")
    if layers is None:
        layers = [LINEAR if i % 4 != 3 else INDEXED for i in range(n)]
    layers = [INDEXED if t == "full_attention" else t for t in layers]
    idx = text.get("indexer_types")
    if idx is None:
        pattern = text.get("index_topk_pattern")
        if pattern is not None:
            letters = {"F": "full", "S": "shared"}
            idx = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(int(text.get("index_topk_freq", 1)), 1)
            offset = int(text.get("index_skip_topk_offset", 2))
            idx = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return list(layers), list(mlp), list(idx)


def linear_attention(text: dict, where: str, defaults: dict) -> dict:
    """The linear_* keys, with the linear_attn_config dict form applied over them."""
    out = {k: text.get(k, defaults[k]) for k in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
                                                  "linear_lower_bound")}
    extra = text.get("linear_attn_config")
    if extra is None:
        return out
    names = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
             "short_conv_kernel_size": "linear_conv_kernel_dim", "gate_lower_bound": "linear_lower_bound"}
    for key in extra:
        if key not in names and key != "safe_gate":
            raise QualError(f"{where}: unsupported key linear_attn_config.{key} (not implemented)")
    for key, name in names.items():
        if key in extra:
            out[name] = extra[key]
    if extra.get("safe_gate", True) and out["linear_lower_bound"] is None:
        out["linear_lower_bound"] = -5.0  # transformers: a safe gate without a bound gets -5
    return out
