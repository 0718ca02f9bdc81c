"""What a checkpoint's safetensors files hold, read from their headers alone (no tensor, no torch).

The plan calls `inspect_weights` for every local checkpoint before anything runs: a truncated file and a
cast that would change the model are refused here, for every engine, and by `--dry-run` too.
"""

from __future__ import annotations

from pathlib import Path

from qual.checkpoints.fp8 import SCALE_SUFFIX
from qual.errors import QualError
from qual.userfiles import open_safetensors

# safetensors' dtype codes by the names profiles use (torch's).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
WEIGHT_DTYPES = tuple(SAFETENSORS_DTYPES.values())
# Casts a run makes without being told: exact widening of bfloat16 and float32 (bfloat16 is float32 with a
# shorter mantissa and the format these models are released in: the shipped toy is bfloat16 run in
# float32), and rounding float64/float32 down to the lower precision the run's dtype asks for.
IMPLIED_CASTS = {
    "bfloat16": frozenset({"float32", "float64"}),
    "float32": frozenset({"float64", "bfloat16", "float16"}),
    "float64": frozenset({"float32", "bfloat16", "float16"}),
}


def cast_refusal(stored: str, run_dtype: str, declared: str | None) -> str | None:
    """Why weights stored as `stored` must not silently become `run_dtype` (None: they may).

    Integer (quantized) and float8 weights lose their scales in a plain cast, and float16 weights have a
    narrower exponent range than the bfloat16/float32 models they are usually converted from: either cast
    runs another model, whose collapse would read as a gate failure. A profile that declares the stored
    dtype (`weights_dtype`) asks for the cast knowingly."""
    if stored == run_dtype or stored == declared or run_dtype in IMPLIED_CASTS.get(stored, ()):
        return None
    return (f"weights stored as {stored} would be cast to {run_dtype}, which changes the model; set the "
            f"profile's `weights_dtype: {stored}` to cast them knowingly")


def inspect_weights(path: str | Path, run_dtype: str, declared: str | None, where: str) -> dict[str, str]:
    """{tensor: stored dtype} of a checkpoint directory; QualError for a missing, truncated or unreadable
    safetensors file, or a tensor the run may not cast (cast_refusal)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QualError(f"{where}: checkpoint {path} has no *.safetensors files")
    dtypes: dict[str, str] = {}
    for f in files:
        try:  # safe_open checks the header and that the file holds every tensor it lists (truncation)
            with open_safetensors(f, "numpy") as st:
                for name in st.keys():
                    code = st.get_slice(name).get_dtype()
                    dtypes[name] = SAFETENSORS_DTYPES.get(code, code.lower())
        except QualError as exc:  # a FIFO, a device, a truncated or unreadable file: named with the checkpoint
            raise QualError(f"{where}: {exc}") from None
    for name, stored in dtypes.items():
        if name + SCALE_SUFFIX in dtypes:  # FP8 with block scales: dequantized by the loader, not cast
            continue
        why = cast_refusal(stored, run_dtype, declared)
        if why:
            raise QualError(f"{where}: {path}: tensor {name!r}: {why}")
    return dtypes
