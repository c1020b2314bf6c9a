"""A restarted process serves again sooner when its start imports nothing it does not use: the `cacheflow`
command (every pod, worker and coordinator starts through it) and the worker's model code leave torch's
compiler stack (torch._dynamo, about a second of CPU, more on a loaded host) unimported."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["cacheflow_services.cli", "cacheflow_services.worker.main",
                                    "cacheflow_services.storage.main"])
def test_starting_a_service_does_not_import_the_torch_compiler(module):
    check = f"import sys, {module}; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
