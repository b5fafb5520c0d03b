"""Build entry point. The package itself is pure Python (configured in pyproject.toml);
this file exists to build the optional C++/CUDA extension of ftshims.kernels."""

from setuptools import setup

setup()
