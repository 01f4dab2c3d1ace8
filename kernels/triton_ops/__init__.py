"""The Triton implementations, one module per op of kernels/: `@triton.jit` kernels, their launch configurations,
and a launcher `<op>_triton` with the contract of the op's PyTorch reference.

The dispatchers import these modules inside their body, once kernels/dispatch.py chose Triton; besides the tests,
only kernels/compile_check.py imports them too, so everything else runs where triton is missing.

Triton fixes its mode when first imported: triton.language builds its own @jit helpers (tl.max, tl.sum, tl.cdiv,
...) for the interpreter or for the compiler, as TRITON_INTERPRET says at that moment, and `@triton.jit` reads the
variable when each kernel is defined. A kernel of one mode cannot call helpers of the other, so this package
refuses to load when the two disagree, that is when triton was imported before TRITON_INTERPRET was set (or unset).
"""
import triton.language as tl

from kernels.dispatch import interpreting

if (type(tl.standard.cdiv).__name__ == "InterpretedFunction") != interpreting():
    now, then = ("set", "unset") if interpreting() else ("unset", "set")
    raise RuntimeError(f"TRITON_INTERPRET is {now} but triton was imported while it was {then}: triton.language's "
                       "own helpers are built for the mode at import, and kernels of the other mode cannot call them; "
                       "set the variable before anything imports triton (e.g. in a conftest)")
