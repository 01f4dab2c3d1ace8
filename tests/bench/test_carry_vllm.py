"""bench/carry_vllm.py's GPU-side half on tiny wheels: slimming, parts carried in two calls and stashed between
them, a second `prepare` appended as another xz stream, the sha256 checks and the missing-part error."""
from __future__ import annotations

import io
import lzma
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench import carry_vllm


def make_wheel(path: Path, pkg: str, files: dict[str, bytes]) -> Path:
    whl = path / f"{pkg}-1.0-py3-none-any.whl"
    info = f"{pkg}-1.0.dist-info"
    members = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 1.0\n".encode(),
               f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in [*members, f"{info}/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for n, data in {**members, f"{info}/RECORD": record.encode()}.items():
            z.writestr(n, data)
    return whl


def xz_tar(paths: list[Path]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in paths:
            tar.add(p, arcname=p.name)
    return lzma.compress(buf.getvalue())


def test_slim_wheel_drops_members_and_their_record_lines(tmp_path):
    src = make_wheel(tmp_path, "vllm", {"vllm/__init__.py": b"", "vllm/_moe_C.abi3.so": b"x" * 100,
                                        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"y",
                                        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"z"})
    (tmp_path / "out").mkdir()
    dropped, freed = carry_vllm.slim_wheel(src, tmp_path / "out" / src.name)
    assert sorted(dropped) == ["vllm/_moe_C.abi3.so", "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so"]
    assert freed == 101
    with zipfile.ZipFile(tmp_path / "out" / src.name) as z:
        names = z.namelist()
        record = z.read("vllm-1.0.dist-info/RECORD").decode()
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    assert "vllm/_moe_C.abi3.so" not in names and "vllm/_moe_C.abi3.so" not in record
    assert "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so" in names and "cpython-312" in record


def test_two_calls_stash_then_install(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    a = make_wheel(wheels, "carrya", {"carrya/__init__.py": b"X = 1\n" + b"# pad\n" * 4000})
    b = make_wheel(wheels, "carryb", {"carryb.py": b"Y = 2\n"})
    packed = xz_tar([a]) + xz_tar([b])               # a second `prepare` appends a stream of its own tar
    prep = tmp_path / "prep"
    prep.mkdir()
    cap = len(packed) / 2.5
    parts = carry_vllm.write_parts(prep, packed, part_mb=cap / 2**20, wheels=[a.name, b.name])
    sizes = [p["bytes"] for p in parts]
    assert len(parts) == 3 and sum(sizes) == len(packed) and max(sizes) <= cap
    assert sizes[0] == sizes[1] and sizes[0] - 3 < sizes[2] <= sizes[0]      # equal but for the rounding
    stash, site = tmp_path / "stash", tmp_path / "site"

    def call(carried: list[str]) -> Path:             # what one device call sees in its .carry/
        d = tmp_path / f"call-{'-'.join(carried)}"
        d.mkdir()
        for n in [*carried, "vllm.json"]:
            (d / n).write_bytes((prep / n).read_bytes())
        return d

    c2 = call(["vllm.part3"])
    with pytest.raises(SystemExit, match=r"vllm.part1 is neither carried nor stashed.*carry .carry/vllm.part1"):
        carry_vllm.main(["install", "--carry", str(c2), "--stash", str(stash), "--site", str(site)])
    carry_vllm.main(["stash", "--carry", str(call(["vllm.part1", "vllm.part2"])), "--stash", str(stash)])
    assert sorted(p.name for p in stash.iterdir()) == ["vllm.part1", "vllm.part2"]
    carry_vllm.main(["install", "--carry", str(c2), "--stash", str(stash), "--site", str(site)])
    monkeypatch.syspath_prepend(str(site))
    import carrya
    import carryb
    assert (carrya.X, carryb.Y) == (1, 2)
    sys.modules.pop("carrya"), sys.modules.pop("carryb")


def test_corrupt_part_is_refused(tmp_path):
    prep = tmp_path / "prep"
    prep.mkdir()
    carry_vllm.write_parts(prep, lzma.compress(b"\0" * 1024), part_mb=1.0)
    (prep / "vllm.part1").write_bytes(b"junk")
    with pytest.raises(SystemExit, match="does not match its sha256"):
        carry_vllm.main(["stash", "--carry", str(prep), "--stash", str(tmp_path / "stash")])
    with pytest.raises(SystemExit, match="do not match vllm.json's sha256"):
        carry_vllm.main(["install", "--carry", str(prep), "--stash", str(tmp_path / "stash"),
                         "--site", str(tmp_path / "site")])
