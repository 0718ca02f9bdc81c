"""The vLLM engine adapter: drives a real `vllm serve` for one arm (docs/vllm.md)."""

from qual.engines.vllm.engine import DCP_NEEDS_GPU, VllmEngine, dry_run_command

__all__ = ["DCP_NEEDS_GPU", "VllmEngine", "dry_run_command"]
