"""ftshims' own kernels.

``ftshims.kernels.rotary``: rotary position embedding (RoPE) with the phase
computed in fp32 inside the kernel, from a runtime ``rope_theta``, an fp32
``inv_freq`` or given cos/sin tables. Backends: a compiled C++/CUDA extension
(built ahead of time by ``setup.py`` or just-in-time on first use) and a
pure-PyTorch reference that is both the fallback and the test oracle.

Importing this package imports nothing heavy; torch is imported when a kernel
is first used.
"""
