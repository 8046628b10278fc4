"""Loaded at start-up when ci/gpu-bare/run puts this folder on PYTHONPATH (the machine has no
sgl_kernel): placeholder packages for the CUDA-only libraries that are missing (carry_standin)."""

import carry_standin

carry_standin.install()
