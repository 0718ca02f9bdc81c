# The op alone (vLLM venv python): vllm._custom_ops.rms_norm with a stacked [layers, D] weight uses row 0 for all.
import torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
x = torch.randn(2, 5, 1, 8)
w = torch.stack([torch.full((8,), 1.0), torch.full((8,), 3.0)])
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
ref = torch.nn.functional.rms_norm(x, (8,), None, 1e-6) * w[:, None, None, :]
ref0 = torch.nn.functional.rms_norm(x, (8,), None, 1e-6) * w[0]
print("per-layer weights:", torch.allclose(out, ref, atol=1e-5), "| layer-0 weight for all:", torch.allclose(out, ref0, atol=1e-5))
