"""Dev-environment shim (installed into .venv by scripts/setup.sh; not part of earlywarn).

The conformance suite trains torchvision's ResNet-18, and the only torchvision wheel for torch 2.13
on this project's package index is built against the CUDA build of torch. Beside the CPU build its
C++ extension (the detection operators nms / roi_align, which ResNet never calls) cannot load, and
``import torchvision`` then fails while registering fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` -- which also breaks ``transformers``, which imports torchvision when it is
installed. This finder runs only when ``torchvision`` is first imported: if the extension loads, it
does nothing; if not, it declares those two operator schemas so the pure-Python parts import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


class _TorchvisionCpuShim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return spec
        import glob

        import torch

        so = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so"))
        try:
            if so:
                torch.ops.load_library(so[0])
                return spec
        except OSError:
            pass
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            try:
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass
        _TorchvisionCpuShim.lib = lib  # keep the registration alive
        return spec


sys.meta_path.insert(0, _TorchvisionCpuShim())
