"""Test-session setup: without a GPU, Triton kernels run in Triton's interpreter on the CPU
(float32 only). Set before any test module imports kernels.py, since triton.jit reads it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests never reach the network: lm-eval's datasets library reads local files only.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
