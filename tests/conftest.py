"""Test-session setup. Triton fixes its interpreter mode when first imported, so without a GPU the interpreter
must be switched on before anything imports triton: here, before any test module is collected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
