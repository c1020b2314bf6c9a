"""What loading the connector costs vLLM's scheduler process: vLLM imports the connector's module in every
process, and the scheduler's side plans loads and saves but never restores, so the module must not load
the restore engine (`worker.py` and `cacheflow_common.engine`: 2.4 MiB of resident memory, measured beside
vLLM and torch). Run with vLLM's Python, as vLLM loads it."""

from __future__ import annotations

import subprocess

from tests.vllm.helpers import VLLM_PYTHON, vllm_env

PROBE = ("import sys, cacheflow_services.vllm_connector.connector; "
         "print(sorted(m for m in sys.modules if m.startswith(('cacheflow_common.engine', "
         "'cacheflow_services.vllm_connector.worker'))))")


def test_the_connector_module_does_not_load_the_restore_engine(tmp_path):
    loaded = subprocess.run([str(VLLM_PYTHON), "-P", "-c", PROBE], capture_output=True, text=True, check=True,
                            env=vllm_env(), cwd=tmp_path, timeout=120).stdout.strip().splitlines()
    assert loaded[-1] == "[]"
