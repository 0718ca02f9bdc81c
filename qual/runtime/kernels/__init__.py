"""Hand-written GPU kernels (Triton), each optional: the runtime falls back to PyTorch without them."""
