"""Checkpoint formats, one module each: read (config parsed and validated) and write (tests, toy, benchmarks).

io: config.json and safetensors files; qwen3: the Hugging Face Qwen3 target; dflash: the public DFlash drafter
format vLLM loads; weights: what the safetensors files hold, from their headers (truncation, dtype casts).
"""
