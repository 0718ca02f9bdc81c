"""GLM-5.3-Flash (transformers glm5_next): the exact math of its text stack as pure functions over explicit state.

config (Glm5Config), weights (safetensors -> one TP rank's shard), kda, mla, dsa + topk (indexer, pooled keys,
DCP-exact selection), moe, mhc, target (the paged, TP- and DCP-sharded target), sizing (bytes per rank). The unpaged
whole-stack forward the paged runtime is tested against is a test oracle: tests/glm5_unpaged.py.
"""
