"""Stand-in for torchaudio in the LLaMA-Factory runs (this directory is on their PYTHONPATH only).

LLaMA-Factory >= 0.9.4 imports torchaudio at module level (``llamafactory/data/mm_plugin.py``:
``import torchaudio``) but calls it only for audio inputs (``torchaudio.load`` / ``.functional.resample``).
PyPI's torchaudio wheels are CUDA builds (``_torchaudio.so`` needs ``libc10_cuda.so``) and the CPU wheels
live on download.pytorch.org, which the test machines cannot reach; with no distribution metadata here,
transformers' ``is_torchaudio_available()`` stays False, so nothing else picks this module up.
"""


def __getattr__(name):
    raise AttributeError(f"torchaudio.{name}: this is the ftshims client tests' stub; no audio in these runs")
