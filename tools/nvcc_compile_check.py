#!/usr/bin/env python
"""CI compile check of the CUDA rotary sources without a GPU and without a CUDA build of torch.

Compiles ``csrc/rotary_cuda.cu`` with ``nvcc -c`` for sm_80 and sm_90 (override
with ``--arch 80 90 ...``) against the headers of the *installed* torch, which
may be the CPU wheel: the .cu includes only c10 headers, and
``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE`` stands in for the one generated header
the CPU wheel lacks. Also compiles ``csrc/rotary.cpp`` with
``-DFTSHIMS_WITH_CUDA`` (``-fsyntax-only``) so the CUDA registration block is
checked too. Prints ptxas register/spill figures; fails on any error or spill.

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
        cmd = [nvcc, "-c", str(REPO / "csrc" / "rotary_cuda.cu"), "-o", os.path.join(tmp, "rotary_cuda.o"), std, "-O3",
               "-Xptxas", "-v", "--expt-relaxed-constexpr"] + defines + includes + gencode
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
