#!/usr/bin/env python
"""CI compile check of the CUDA rotary sources without a GPU and without a CUDA build of torch.

Compiles ``csrc/rotary_cuda.cu`` with ``nvcc -c`` for sm_80 and sm_90 (override
with ``--arch 80 90 ...``) against the headers of the *installed* torch, which
may be the CPU wheel: the .cu includes only c10 headers, and
``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE`` stands in for the one generated header
the CPU wheel lacks. Also compiles ``csrc/rotary.cpp`` with
``-DFTSHIMS_WITH_CUDA`` (``-fsyntax-only``) so the CUDA registration block is
checked too. Prints ptxas register/spill figures; fails on any error or spill.

It also reads the PTX of every architecture: each vectorised kernel instance
(``rotary_kernel<..., VEC=true>``) must move q and k with 16-byte global loads
and stores only (``ld/st.global.v4.u32``-class), the memory pattern the kernel
is written for; a change that lets the compiler split them fails here.

    python tools/nvcc_compile_check.py            # nvcc from PATH or $CUDA_HOME/bin
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_ENTRY = re.compile(r"\.entry\s+(\S+)\(")
_KERNEL = re.compile(r"rotary_kernelI.*?Li(\d+)ELb([01])ELb([01])E")  # <T, C, P, INTER, VEC>
_LD16 = re.compile(r"ld\.global(?:\.nc)?\.(?:v4\.(?:u32|b32|f32|s32)|v2\.(?:u64|b64|f64))")
_ST16 = re.compile(r"st\.global\.(?:v4\.(?:u32|b32|f32|s32)|v2\.(?:u64|b64|f64))")


def vector_access_report(ptx: str) -> tuple:
    """(vectorised kernels checked, problems) for one PTX file."""
    checked, problems = 0, []
    for body in re.split(r"\n(?=\.(?:visible|weak) \.entry|\.entry)", ptx):
        entry = _ENTRY.search(body)
        kernel = _KERNEL.search(entry.group(1)) if entry else None
        if kernel is None or kernel.group(3) != "1":
            continue
        checked += 1
        interleaved = kernel.group(2) == "1"
        loads16, stores16 = len(_LD16.findall(body)), len(_ST16.findall(body))
        stores = len(re.findall(r"st\.global", body))
        want = 1 if interleaved else 2  # one vector of pairs, or one per half
        if loads16 < want or stores16 < want or stores != stores16:
            problems.append(f"{entry.group(1)}: {loads16} 16-byte loads, {stores16} 16-byte stores of {stores} "
                            f"global stores (want >= {want}, all stores 16-byte)")
    return checked, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["80", "90"])
    args = parser.parse_args(argv)
    import torch
    from torch.utils.cpp_extension import include_paths

    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        print("nvcc not found (PATH or $CUDA_HOME/bin)", file=sys.stderr)
        return 2
    std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14) else "-std=c++17"
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{REPO / 'csrc'}"]
    defines = ["-DFTSHIMS_WITH_CUDA", "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in args.arch]
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        keep = os.path.join(tmp, "keep")
        os.makedirs(keep)
        cmd = [nvcc, "-c", str(REPO / "csrc" / "rotary_cuda.cu"), "-o", os.path.join(tmp, "rotary_cuda.o"), std, "-O3",
               "-Xptxas", "-v", "--expt-relaxed-constexpr", "--keep", "--keep-dir", keep] + defines + includes + gencode
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.time() - t0
        log = proc.stdout + proc.stderr
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", log)]
        if proc.returncode != 0:
            print(log)
            failed = True
        print(f"nvcc {' '.join('sm_' + a for a in args.arch)}: rc={proc.returncode} {seconds:.1f}s, "
              f"{len(regs)} kernels, max {max(regs, default=0)} registers, {sum(1 for s in spills if s)} with spills")
        if any(spills):
            failed = True
        ptx_files = sorted(Path(keep).glob("*.ptx"))
        checked, problems = 0, []
        for ptx in ptx_files:
            c, p = vector_access_report(ptx.read_text(errors="replace"))
            checked += c
            problems += [f"{ptx.name}: {x}" for x in p]
        print(f"ptx: {len(ptx_files)} files, {checked} vectorised kernels, {len(problems)} without 16-byte loads/stores only")
        for problem in problems:
            print("  " + problem)
        if proc.returncode == 0 and (not ptx_files or checked == 0 or problems):
            failed = True
        cxx = os.environ.get("CXX", "c++")
        host = [cxx, "-fsyntax-only", str(REPO / "csrc" / "rotary.cpp"), std, "-DFTSHIMS_WITH_CUDA"] + includes
        t0 = time.time()
        proc = subprocess.run(host, capture_output=True, text=True)
        print(f"{cxx} -fsyntax-only rotary.cpp -DFTSHIMS_WITH_CUDA: rc={proc.returncode} {time.time() - t0:.1f}s")
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
