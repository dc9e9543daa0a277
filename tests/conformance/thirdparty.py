"""Importing the third-party packages the conformance suite trains inside (all pinned in
scripts/constraints.txt), and a little real text for them to learn."""

from __future__ import annotations

import os
import sysconfig
from functools import lru_cache

import torch


def import_torchvision():
    """torchvision (beside the CPU build of torch it needs scripts/torchvision_cpu_shim.py, which
    scripts/setup.sh installs into the venv)."""
    import torchvision

    return torchvision


@lru_cache(maxsize=1)
def text_tokens(max_bytes: int = 400_000) -> torch.Tensor:
    """Real text with no download: the standard library's own ``.py`` files, bytes folded to 7 bits."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as fh:
                    data = fh.read()
                chunks.append(data)
                total += len(data)
                if total >= max_bytes:
                    buf = b"".join(chunks)[:max_bytes]
                    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).long() & 127
    buf = b"".join(chunks)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).long() & 127
