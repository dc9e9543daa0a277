"""Module boundaries users rely on: the pure parts import without torch, the core without trackers."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap

PURE = ["earlywarn", "earlywarn.events", "earlywarn.detect", "earlywarn.policy", "earlywarn.metrics",
        "earlywarn.sinks", "earlywarn.sinks.defaults", "earlywarn.analyze", "earlywarn.cli"]
CORE = ["earlywarn.guard", "earlywarn.recover", "earlywarn.capture.gradstats"]


def _run(code: str) -> subprocess.CompletedProcess:
    # Run outside the checkout: what is importable must come from the installed package.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tempfile.gettempdir())


def test_pure_modules_import_with_torch_blocked():
    proc = _run(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import importlib
        for m in {PURE!r}:
            importlib.import_module(m)
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_core_never_imports_trackers_or_trainer_frameworks():
    proc = _run(f"""
        import sys, importlib
        for m in {PURE + CORE!r}:
            importlib.import_module(m)
        import earlywarn
        earlywarn.watch, earlywarn.ResumableLoader
        banned = [m for m in ("wandb", "mlflow", "lightning", "pytorch_lightning", "transformers", "accelerate") if m in sys.modules]
        assert not banned, banned
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr


def test_integrations_install_under_earlywarn_not_as_a_bare_top_level_package():
    proc = _run("""
        import importlib.util
        assert importlib.util.find_spec("earlywarn.integrations") is not None
        assert importlib.util.find_spec("integrations") is None, "a bare 'integrations' package would clash"
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
