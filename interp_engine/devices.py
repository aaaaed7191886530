"""Where weights and activations go: a device named by the user, checked before anything moves.

Asking for ``device="cuda"`` on a machine where torch sees no CUDA device would otherwise fail
deep inside torch (``Torch not compiled with CUDA enabled``) after the weights were read; the
library says it up front, with what to do instead.
"""

from __future__ import annotations

from .errors import InputError


def check_device(device) -> None:
    """Refuse a CUDA device on a machine where torch has none, before any weight is loaded."""
    import torch

    text = str(device)
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device={text!r}, but torch sees no CUDA device here (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}); use device='cpu', or leave device out")
