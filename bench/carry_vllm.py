"""Bring vLLM to a GPU machine that has no network: download and pack here, unpack and install there.

    python bench/carry_vllm.py prepare              # here (a package registry reachable): writes .carry/
    python3 bench/carry_vllm.py stash               # GPU machine, call 1 (carries .carry/vllm.part1)
    python3 bench/carry_vllm.py install --check     # GPU machine, call 2 (carries .carry/vllm.part2)
    PYTHONPATH=/tmp/vllm_site python3 bench/vs_vllm.py ...

`prepare` downloads vLLM's wheel (its metadata must pin the GPU image's torch) and the pure-Python and small binary
dependencies that the GPU image lacks (LEAN_DEPS; Python 3.12, manylinux x86_64, `pip download --no-deps`), drops
the extensions a dense bf16 model on Hopper never loads (DROP: FlashAttention 2, the MoE kernels, FlashMLA, the Rust
frontend, DeepGEMM builds for other Pythons; each import is guarded in vLLM), stores the wheels uncompressed in one
tar, compresses it with xz and splits it into parts of at most --part-mb MiB (.carry/vllm.part1, part2, ...) plus
.carry/vllm.json (sha256 of each part and of the whole). .carry/ ignores itself (.carry/.gitignore), so the parts are
never committed and travel to the GPU machine only when a call names them in `carry`.

A call may carry at most 64 MiB, so the parts go in back-to-back calls; the machine stays warm ~30 s after a call and
/tmp survives while it does. `stash` (call 1) checks part 1 and copies it to /tmp/vllm_carry; `install` (call 2)
joins the stashed parts with the one carried, checks the sha256, unpacks the wheels and runs
`pip install --no-index --no-deps --target /tmp/vllm_site`. A missing stashed part (the machine went cold between
calls) is a one-line error naming the part to carry again. `stash` and `install` use only the standard library and
pip, so they run on the GPU image's python3 as it is.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".carry"
STASH = Path("/tmp/vllm_carry")
SITE = Path("/tmp/vllm_site")

VLLM = "vllm==0.22.0"
TORCH_PIN = "torch==2.11.0"   # the GPU image's torch (2.11.0+cu130): vLLM's metadata must pin exactly this
# glibc tags the image's Ubuntu (Python 3.12.3, glibc 2.39) accepts
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (5, 17, 24, 26, 27, 28, 31, 34, 35, 39)] + ["manylinux2014_x86_64",
                                                                                          "manylinux1_x86_64"]
# What `from vllm import LLM` and an offline generate import that the GPU image (its package list) lacks or holds
# too old; structured-output, serving, tracing and MoE/quantization kernel packages load lazily and stay behind.
LEAN_DEPS = [  # pinned near vLLM 0.22.0's release: newer openai/fastapi/starlette pull httpx2 and opentelemetry
    "pydantic==2.12.5", "pydantic-core==2.41.5", "annotated-types", "typing-inspection", "typing-extensions>=4.14.1",
    "fastapi==0.135.0", "starlette<1", "openai<3", "jiter<1", "distro", "sniffio", "openai-harmony", "pyzmq",
    "cbor2", "msgspec", "blake3", "pybase64", "setproctitle", "cachetools", "diskcache==5.6.3", "gguf",
    "lark==1.2.2", "compressed-tensors==0.15.0.1", "loguru", "depyf==0.20.0", "astor", "dill", "partial-json-parser",
    "prometheus-fastapi-instrumentator<8", "python-json-logger", "ijson", "watchfiles",
    # structured output: vllm.v1.request imports both backends, whose dataclass annotations load the modules
    "llguidance>=1.7.0,<1.8.0", "xgrammar<1.0.0,>=0.2.0", "apache-tvm-ffi>=0.1.11,<0.2",
]
DROP = [  # members of vLLM's wheel a dense bf16 model on H200 never loads (imports guarded: try/except, suppress)
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",   # FlashAttention 2; FA3 serves Hopper
    "vllm/_moe_C.abi3.so",                          # fused-MoE kernels (contextlib.suppress(ImportError))
    "vllm/_flashmla_C.abi3.so",                     # FlashMLA (MLA models only)
    "vllm/vllm-rs",                                 # Rust frontend, only with VLLM_USE_RUST_FRONTEND
    "vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so",  # DeepGEMM for Pythons other than the image's 3.12
]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pip_download(reqs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(dest), *[f"--platform={p}" for p in PLATFORMS], *reqs]
    subprocess.run(cmd, check=True, timeout=1800)


def wheel_metadata(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode().splitlines()


def check_torch_pin(whl: Path) -> None:
    """Exits unless the wheel's Requires-Dist pins the GPU image's torch."""
    reqs = [ln.split(":", 1)[1].strip().replace(" ", "") for ln in wheel_metadata(whl)
            if ln.startswith("Requires-Dist:")]
    if TORCH_PIN not in reqs:
        asks = [r for r in reqs if r.startswith("torch")]
        sys.exit(f"carry_vllm: {whl.name} does not pin {TORCH_PIN} (it asks {asks})")


def slim_wheel(src: Path, dest: Path) -> tuple[list[str], int]:
    """Copies the wheel without the DROP members (and their RECORD lines), stored uncompressed so that xz sees the raw
    bytes; returns the dropped names and the bytes they held."""
    dropped, freed = [], 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if any(fnmatch.fnmatch(info.filename, pat) for pat in DROP):
                dropped.append(info.filename)
                freed += info.file_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                keep = [ln for ln in data.decode().splitlines() if ln.split(",", 1)[0] not in DROP
                        and not any(fnmatch.fnmatch(ln.split(",", 1)[0], pat) for pat in DROP)]
                data = ("\n".join(keep) + "\n").encode()
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
    return dropped, freed


def xz(data: bytes, extreme: bool) -> bytes:
    """xz -9 through the xz tool on both cores where there is one (multi-block), else Python's lzma."""
    if shutil.which("xz"):
        flags = ["-9e" if extreme else "-9", "-T0", "-c"]
        return subprocess.run(["xz", *flags], input=data, stdout=subprocess.PIPE, check=True, timeout=7200).stdout
    return lzma.compress(data, preset=9 | lzma.PRESET_EXTREME if extreme else 9)


def reuse(names: list[str], dropped: list[str]) -> tuple[bytes, list[str]]:
    """The packed bytes of an earlier `prepare` and the wheels they hold, when all of those are still wanted and
    slimmed the same way: new wheels are then appended as one more xz stream of one more tar (`install` reads
    concatenated streams and tars), so adding a dependency does not compress vLLM again."""
    path = CARRY / "vllm.json"
    if not path.exists():
        return b"", []
    m = json.loads(path.read_text())
    parts = [CARRY / p["name"] for p in m["parts"]]
    if m.get("dropped") != dropped or not set(m["wheels"]) <= set(names) or not all(p.exists() for p in parts):
        return b"", []
    packed = b"".join(p.read_bytes() for p in parts)
    return (packed, m["wheels"]) if sha256(packed) == m["sha256"] else (b"", [])


def write_parts(carry: Path, packed: bytes, part_mb: float, **extra) -> list[dict]:
    """Splits the packed bytes into equal parts of at most part_mb MiB (each call keeps the same headroom) as
    carry/vllm.partN, and writes carry/vllm.json: each part's size and sha256, the whole's, and `extra`."""
    cap = int(part_mb * 2**20)
    n = max(1, -(-len(packed) // cap))
    size = -(-len(packed) // n)
    for old in carry.glob("vllm.part*"):
        old.unlink()
    parts = []
    for i in range(n):
        chunk = packed[i * size:(i + 1) * size]
        (carry / f"vllm.part{i + 1}").write_bytes(chunk)
        parts.append({"name": f"vllm.part{i + 1}", "bytes": len(chunk), "sha256": sha256(chunk)})
    m = {"vllm": VLLM, "torch": TORCH_PIN, "sha256": sha256(packed), "bytes": len(packed), "parts": parts, **extra}
    (carry / "vllm.json").write_text(json.dumps(m, indent=1) + "\n")
    return parts


def prepare(args) -> None:
    dl = CARRY / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    (CARRY / ".gitignore").write_text("*\n")    # the folder ignores itself: parts are carried, never committed
    t0 = time.time()
    pip_download([VLLM, *LEAN_DEPS], dl)
    vllm_whl = next(dl.glob(f"vllm-{VLLM.split('==')[1]}-*.whl"))
    check_torch_pin(vllm_whl)
    wheels = CARRY / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    dropped, freed = slim_wheel(vllm_whl, wheels / vllm_whl.name)
    print(f"carry_vllm: {vllm_whl.name}: {vllm_whl.stat().st_size / 2**20:.1f} MiB; dropped {len(dropped)} members "
          f"({freed / 2**20:.0f} MiB uncompressed): {', '.join(Path(d).name for d in dropped)}")
    for w in sorted(dl.glob("*.whl")):
        if w != vllm_whl:
            shutil.copy2(w, wheels / w.name)
    names = sorted(w.name for w in wheels.iterdir())
    packed, had = reuse(names, dropped)
    todo = [n for n in names if n not in had]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in todo:
            tar.add(wheels / name, arcname=name)
    print(f"carry_vllm: {len(names)} wheels, {len(had)} already packed; compressing {len(todo)} "
          f"({buf.tell() / 2**20:.1f} MiB tar, xz -9)")
    packed += xz(buf.getvalue(), args.extreme) if todo else b""
    parts = write_parts(CARRY, packed, args.part_mb, wheels=had + todo, dropped=dropped)
    for p in parts:
        print(f"carry_vllm: .carry/{p['name']}: {p['bytes'] / 2**20:.1f} MiB")
    print(f"carry_vllm: {len(packed) / 2**20:.1f} MiB in {len(parts)} parts, manifest .carry/vllm.json "
          f"({time.time() - t0:.0f} s)")


def manifest(carry: Path) -> dict:
    path = carry / "vllm.json"
    if not path.exists():
        sys.exit(f"carry_vllm: {path} missing: carry .carry/vllm.json in every call")
    return json.loads(path.read_text())


def stash(args) -> None:
    """Copies every part this call carried, checked, to the stash (the parts a later call will not carry)."""
    m = manifest(args.carry)
    args.stash.mkdir(parents=True, exist_ok=True)
    found = 0
    for p in m["parts"]:
        src = args.carry / p["name"]
        if src.exists():
            if sha256(src.read_bytes()) != p["sha256"]:
                sys.exit(f"carry_vllm: {src} does not match its sha256 in vllm.json: carry it again")
            shutil.copy2(src, args.stash / p["name"])
            found += 1
            print(f"carry_vllm: stashed {p['name']} in {args.stash}")
    if not found:
        sys.exit(f"carry_vllm: no part in {args.carry}: name .carry/vllm.partN in this call's carry")


def install(args) -> None:
    """Joins the parts (carried or stashed), checks them, unpacks the wheels, pip installs them into --site."""
    m = manifest(args.carry)
    chunks = []
    for p in m["parts"]:
        src = next((d / p["name"] for d in (args.carry, args.stash) if (d / p["name"]).exists()), None)
        if src is None:
            sys.exit(f"carry_vllm: {p['name']} is neither carried nor stashed in {args.stash} (the machine went cold "
                     f"between calls?): carry .carry/{p['name']} with `stash` again, then this call")
        chunks.append(src.read_bytes())
    packed = b"".join(chunks)
    if sha256(packed) != m["sha256"]:
        sys.exit("carry_vllm: the joined parts do not match vllm.json's sha256: parts from different `prepare` runs?")
    t0 = time.time()
    wheels = Path(tempfile.mkdtemp(prefix="vllm_wheels_"))
    # one xz stream and tar per `prepare` that added wheels: lzma reads concatenated streams, ignore_zeros the tars
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(packed)), mode="r", ignore_zeros=True) as tar:
        tar.extractall(wheels, filter="data")
    names = sorted(str(w) for w in wheels.glob("*.whl"))
    print(f"carry_vllm: {len(names)} wheels unpacked in {time.time() - t0:.0f} s; installing into {args.site}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "-q", "--target", str(args.site), "--upgrade", *names],
                   check=True, timeout=600)
    shutil.rmtree(wheels)
    print(f"carry_vllm: installed in {time.time() - t0:.0f} s; use PYTHONPATH={args.site}")
    if args.check:
        code = "import vllm, torch; print('carry_vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
        env = {**os.environ, "PYTHONPATH": str(args.site)}
        if subprocess.run([sys.executable, "-c", code], check=False, env=env, timeout=300).returncode:
            sys.exit(f"carry_vllm: installed, but `import vllm, torch` with PYTHONPATH={args.site} failed (above)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="download, slim, pack and split (needs a package registry)")
    pr.add_argument("--part-mb", type=float, default=60.0, help="largest part, MiB")
    pr.add_argument("--extreme", action="store_true", help="xz -9e: a little smaller, much slower")
    for name, fn in (("stash", stash), ("install", install)):
        s = sub.add_parser(name, help=(fn.__doc__ or "").split("\n")[0])
        s.add_argument("--carry", type=Path, default=CARRY, help="folder holding the carried parts and vllm.json")
        s.add_argument("--stash", type=Path, default=STASH, help="where parts wait between calls")
        if name == "install":
            s.add_argument("--site", type=Path, default=SITE, help="pip install --target")
            s.add_argument("--check", action="store_true", help="then import vllm and torch from --site")
    args = p.parse_args(argv)
    {"prepare": prepare, "stash": stash, "install": install}[args.cmd](args)


if __name__ == "__main__":
    main()
