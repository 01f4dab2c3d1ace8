"""Building the C kernels of cpu/csrc: compiled on first use with the system C compiler, loaded through ctypes.

No torch headers are involved, so a build is one `cc` call of well under a second; the shared object is cached
under `TIDAL_CACHE_DIR` (default `~/.cache/tidal`), keyed by the source (and the files it #includes), the flags,
the compiler and the CPU's feature flags (the build uses `-march=native`), and written by atomic rename under a lock
on the cache directory, so ranks building at once compile each source once.

Nothing here is required: without a C compiler a `NativeLibrary` loads nothing and its callers keep their PyTorch path,
after one warning that says why.
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

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "paged_attention.c"   # `build`'s default source (the engine's paged attention, cpu/attention.py)
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
    """The files `source` #includes from its own directory, and theirs in turn (decode_forward.c includes other
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
    """Compile `source` (the paged-attention kernel unless told) unless a cached build exists, and return the shared
    object's path. Raises RuntimeError naming the compiler command and its output on failure."""
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


class NativeLibrary:
    """One C source of cpu/csrc, built (`build`) and loaded on first use, once per process (thread-safe).
    `load()` gives the library with its functions' signatures declared, or None where it cannot be had (no
    compiler, a failed build; `error` says why), after one warning naming what runs instead."""

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
