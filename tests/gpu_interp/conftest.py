"""Triton's interpreter runs the GPU kernels on the CPU: set before any kernel module is
imported (Triton reads it when a kernel is decorated)."""

import os

os.environ["TRITON_INTERPRET"] = "1"
