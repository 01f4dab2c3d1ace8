"""Kernels: each file holds a Triton kernel, a plain-PyTorch reference with the same signature, and a dispatcher.

KV cache layout, shared with engine/: one (k_cache, v_cache) pair per layer, each [num_blocks, block_size,
num_kv_heads, head_dim]. A token's slot is block_id * block_size + offset; slot -1 means "do not write".
"""
