"""CPU kernels in C, for the engine's CPU path: built on first use with the system C compiler, called through ctypes.

On CPU, PyTorch has no paged attention: the batched path (engine/attention.py) gathers every sequence's KV blocks
into a padded copy and masks the padding, so each decode step writes and re-reads the whole KV context. The C
kernel in `kernels/csrc/paged_attention.c` reads K/V in place through the block table instead (the same walk the
Triton kernels do on GPU), one query row at a time: decode rows, prefill chunks and mixed batches in one call.
No torch headers are involved, so the build is one `cc` call of well under a second; the shared object is cached
under `TIDAL_CACHE_DIR` (default `~/.cache/tidal`), keyed by the source, the flags, the compiler and the CPU's
feature flags (the build uses `-march=native`), and written by atomic rename so ranks building at once do not trip
over each other.

Nothing here is required: without a C compiler (or with `TIDAL_CPU_NATIVE=0`) `native_available()` is
False and the engine keeps the batched PyTorch path, after one warning that says why.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
# Reassociation lets the compiler vectorise the dot products; no -ffinite-math-only, so the NaN checks stay.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
          "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    root = os.environ.get("TIDAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tidal")
    return Path(root)


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's feature flags (a cache shared by different machines must not hand
    one an object built for instructions it lacks)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def local_includes(source: Path) -> set[Path]:
    """The files `source` #includes from its own directory, and theirs in turn (decode_forward.c includes two other
    sources): what its build depends on besides itself."""
    found: set[Path] = set()
    todo = [source]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop().read_text(), flags=re.M):
            f = source.parent / name
            if f not in found and f.exists():
                found.add(f)
                todo.append(f)
    return found


def build(force: bool = False, source: Path = SOURCE) -> Path:
    """Compile `source` (the paged-attention kernel unless told; kernels/cpu_train.py builds its own) unless a
    cached build exists, and return the shared object's path. Raises RuntimeError naming the compiler command and
    its output on failure."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
    src = b"\0".join(f.read_bytes() for f in [source, *sorted(local_includes(source))])
    key = hashlib.sha256(b"\0".join([src, " ".join(CFLAGS).encode(), cc.encode(), _cpu_fingerprint().encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out.parent):   # ranks starting together: one compiles, the others wait for it
        if out.exists() and not force:
            return out
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *CFLAGS, str(source), "-o", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            if res.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


COMPILE_TIMEOUT_S = 120.0


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock on the cache directory while this process compiles (fcntl.flock on the directory itself,
    so no lock file is left behind; released if the process dies). The ranks of a job start together and otherwise
    all compile the same sources at once (the 4-rank tiny job's first step spent ~17 s so on 2 cores with an empty
    cache). The wait has a deadline (the compile's own timeout and a margin): past it, or where flock is unavailable,
    this process compiles on its own, which the atomic rename keeps safe."""
    try:
        import fcntl
        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):   # no flock (Windows), or the directory cannot be opened: compile unlocked
        yield
        return
    try:
        deadline, locked = time.monotonic() + COMPILE_TIMEOUT_S + 30.0, False
        while not locked and time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)   # releases the lock


_sgemm: list[int | None] = []


def sgemm_address() -> int | None:
    """The address of `sgemm_` in torch's CPU library (the BLAS its F.linear calls), for the kernels that call
    it directly (csrc/sgemm.h); None where the build exports none (no MKL, another BLAS)."""
    if not _sgemm:
        lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
        try:
            addr = ctypes.cast(ctypes.CDLL(str(lib), mode=os.RTLD_NOLOAD | os.RTLD_LAZY).sgemm_, ctypes.c_void_p).value
        except (OSError, AttributeError):
            addr = None
        _sgemm.append(addr)
    return _sgemm[0]


def disabled() -> bool:
    """TIDAL_CPU_NATIVE=0 switches every C kernel off (the engine's and the trainer's)."""
    return os.environ.get("TIDAL_CPU_NATIVE", "1").lower() in ("0", "false", "off", "no")


class NativeLibrary:
    """One C source of kernels/csrc, built (`build`) and loaded on first use, once per process (thread-safe).
    `load()` gives the library with its functions' signatures declared, or None where it cannot be had (no
    compiler, a failed build, TIDAL_CPU_NATIVE=0; `error` says why), after one warning naming what runs instead."""

    def __init__(self, source: Path, signatures: dict[str, tuple[list[Any], Any]], instead: str):
        self.source, self.signatures, self.instead = source, signatures, instead
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        if self.lib is not None or self.error is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.error is None:
                if disabled():
                    self.error = "disabled by TIDAL_CPU_NATIVE=0"
                    return None
                try:
                    lib = ctypes.CDLL(str(build(source=self.source)))
                    for name, (args, result) in self.signatures.items():
                        fn = getattr(lib, name)
                        fn.argtypes, fn.restype = args, result
                    self.lib = lib
                except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as e:
                    self.error = str(e)
                    warnings.warn(f"CPU native kernels of {self.source.name} unavailable, {self.instead}: {e}")
        return self.lib

    def require(self) -> ctypes.CDLL:
        """The library, or RuntimeError naming why it cannot be had."""
        lib = self.load()
        if lib is None:
            raise RuntimeError(f"CPU native kernels of {self.source.name} unavailable: {self.error}")
        return lib


PAGED = NativeLibrary(SOURCE, {"paged_attention_f32": (
    [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7
    + [ctypes.c_float, ctypes.c_int], ctypes.c_int)}, "using the batched PyTorch path")


def native_available() -> bool:
    return PAGED.load() is not None


def unavailable_reason() -> str | None:
    PAGED.load()
    return PAGED.error


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (fp32 on CPU, GQA group a whole number)."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and q.shape[1] % k_cache.shape[2] == 0)


def paged_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           row_seq: torch.Tensor, row_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, Hq, D] -> out [R, Hq, D]: row r attends over the first row_len[r] pool tokens of sequence row_seq[r]
    (a row of block_tables [S, W]). Raises on tensors it does not take and on sequence or block ids out of range."""
    lib = PAGED.require()
    if not supports(q, k_cache):
        raise ValueError(f"native paged attention needs fp32 CPU tensors and Hq % Hkv == 0, got q {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}, cache {k_cache.dtype} {tuple(k_cache.shape)}")
    R, Hq, D = q.shape
    num_blocks, bs, Hkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"head_dim mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if row_seq.shape != (R,) or row_len.shape != (R,):
        raise ValueError(f"row_seq {tuple(row_seq.shape)} / row_len {tuple(row_len.shape)} must both be [{R}]")
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    seq = row_seq.to(torch.int32).contiguous()
    lens = row_len.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = lib.paged_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.shape[1],
                                 seq.data_ptr(), lens.data_ptr(), out.data_ptr(), R, Hq, Hkv, D, bs, num_blocks,
                                 bt.shape[0], scale, torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"native paged attention: a row names a sequence outside the {bt.shape[0]} rows of the "
                         f"block table, attends past its {bt.shape[1]} blocks, or reads a block outside the pool's "
                         f"{num_blocks}")
    if rc != 0:
        raise MemoryError("native paged attention: could not allocate its scratch memory")
    return out


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract of kernels.paged_attention.paged_decode_ref (no sliding window): q [B, Hq, D], one query row
    per sequence attending over its context_lens[b] tokens."""
    return paged_attention_native(q, k_cache, v_cache, block_tables, torch.arange(q.shape[0]), context_lens, scale)


def paged_prefill_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract of kernels.paged_attention.paged_prefill_ref (no sliding window): new token i of sequence b
    sits at position context_lens[b] - q_len_b + i and attends to the positions up to its own."""
    rows_seq, rows_len = prefill_rows(cu_seqlens_q, context_lens)
    return paged_attention_native(q, k_cache, v_cache, block_tables, rows_seq, rows_len, scale)


def prefill_rows(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, tokens attended) of every new token of a prefill batch, causal within each sequence."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    T = int(cu_seqlens_q[-1])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=T)
    local = torch.arange(T) - cu_seqlens_q[:-1].long()[seq]
    return seq, context_lens.long()[seq] - q_lens[seq] + local + 1
