"""Kernels: each op has a plain-PyTorch reference and a dispatcher in kernels/<op>.py, and its Triton kernels, in
ordinary Triton (`@triton.jit`, `tl`), in kernels/triton_ops/<op>.py.

KV cache layout, shared with engine/: one (k_cache, v_cache) pair per layer, each [num_blocks, block_size,
num_kv_heads, head_dim]. A token's slot is block_id * block_size + offset; slot -1 means "do not write".

  paged_attention.py  paged_decode (flash-decoding, GQA-packed, split-KV + reduce), re-exports paged_prefill
  paged_prefill.py    paged_prefill (extend attention over a paged prefix; flash-attn when importable)
  kv_cache.py         write_kv (scatter new K/V by slot mapping)
  logprobs.py         token_logprobs (chunked logprob + entropy from hidden states, an autograd Function)
  rmsnorm.py, rope.py rms_norm (+ residual), rope (q and k) for the engine (engine/fused.py): Triton or C
  swiglu.py           silu_mul (SwiGLU's silu(gate) * up), the engine's too
  dispatch.py         the implementation choice (impl / TIDAL_KERNELS)
  triton_ops/         the Triton kernels and their launchers, one module per op above (imports triton)
  memtrack.py         LiveBytes: peak tensor memory on any device (tests and bench/)

Every dispatcher takes `impl=None|"auto"|"triton"|"ref"` (None: the TIDAL_KERNELS variable, default "auto"):
"auto" runs Triton when the tensors are on CUDA and triton is installed, the reference otherwise; "triton" on CPU
tensors runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, the tests' path). A dispatcher imports its
triton_ops module only once it chose Triton, so importing kernels (or engine, model, trainer) never imports triton.
flash-attn is never required.
"""
