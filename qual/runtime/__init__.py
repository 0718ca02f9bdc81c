"""The embedded DCP-aware DFlash runtime (PyTorch over torch.distributed)."""
