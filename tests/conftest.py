"""Test-session setup. Triton fixes its interpreter mode when first imported, so without a GPU the interpreter
must be switched on before anything imports triton: here, before any test module is collected. The optional CPU
backend (cpu/) is enabled as the entry points enable it."""
import os

import pytest
import torch

import cpu

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
cpu.enable()   # the C backend for CPU runs, as the entry points enable it (train.py, rollout.py)
# Under pytest-xdist the workers share the machine's cores, as a job's ranks do: each takes its share of them for
# torch's intra-op threads (the runtime's rule, cpu/process.py). With more threads than cores, tiny ops' threads
# only spin and fight: `-n 2` on 2 cores spent 2-3x the CPU seconds of one thread a worker on the engine's tests.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: intra-op threads only fight (30x slower measured). A module opts in
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
