"""Kernels: each op has a plain-PyTorch reference and a dispatcher in kernels/<op>.py, and its Triton kernels, in
ordinary Triton (`@triton.jit`, `tl`), in kernels/triton_ops/<op>.py.

KV cache layout, shared with engine/: one (k_cache, v_cache) pair per layer, each [num_blocks, block_size,
num_kv_heads, head_dim]. A token's slot is block_id * block_size + offset; slot -1 means "do not write".

  paged_attention.py  paged_decode (flash-decoding, GQA-packed, split-KV + reduce), re-exports paged_prefill
  paged_prefill.py    paged_prefill (extend attention over a paged prefix; flash-attn when importable)
  kv_cache.py         write_kv (scatter new K/V by slot mapping)
  logprobs.py         token_logprobs (chunked logprob + entropy from hidden states, an autograd Function)
  rmsnorm.py, rope.py rms_norm (+ residual), rope (q and k), forward only, for the engine (engine/fused.py)
  swiglu.py           silu_mul (SwiGLU's silu(gate) * up), the engine's too
  sample.py           sample (temperature sampling by inverse CDF + the token's logprob; engine/sampler.py)
  dispatch.py         the implementation choice (impl / TIDAL_KERNELS) and the registry of other backends' kernels
  triton_ops/         the Triton kernels and their launchers, one module per op above (imports triton), and
                      train.py: RMSNorm, SwiGLU and rotary with backward, for the trainer (trainer/fused.py)
  compile_check.py    compiles every Triton kernel for a GPU target without a GPU
  memtrack.py         LiveBytes: peak tensor memory on any device (tests and bench/)

Every dispatcher takes `impl=None|"auto"|"triton"|"ref"` (None: the TIDAL_KERNELS variable, default "auto"):
"auto" runs Triton when the tensors are on CUDA and triton is installed, else an implementation another backend
registered for the op that accepts the tensors (`dispatch.register_impl`: the optional cpu/ package registers its
C kernels of rms_norm, rope, silu_mul and sample for fp32 CPU tensors; forward only, never while autograd records),
else the reference; "triton" on CPU tensors runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, the
tests' path); "ref" always the reference. A dispatcher imports its triton_ops module only once it chose Triton, so
importing kernels (or engine, model, trainer) never imports triton. flash-attn is never required.
"""
