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


LAYOUT_PROBE = """
import sys, types
from cacheflow_services.vllm_connector.connector import _cache_layout
from cacheflow_services.vllm_connector.model_identity import fingerprint_needs_layout
cpu = types.SimpleNamespace(device_config=types.SimpleNamespace(device_type="cpu"))
print(_cache_layout(cpu, exact=False), "vllm.v1.attention.backends.cpu_attn" in sys.modules)
for dtype in ("auto", "fp8"):
    print(dtype, fingerprint_needs_layout(types.SimpleNamespace(cache_config=types.SimpleNamespace(cache_dtype=dtype))))
"""


def test_a_scheduler_whose_chunk_keys_need_no_layout_does_not_load_vllms_cpu_attention(tmp_path):
    """The scheduler's side of a model-dtype cache checks only the CPU's architecture: importing vLLM's CPU
    attention backend to learn its exact kernel costs a process 250 modules (4 MiB), which the driver of a
    tensor- or pipeline-parallel instance does not otherwise load; an fp8 cache's chunk keys need the kernel's
    layout, so its scheduler still asks (this host is x86)."""
    out = subprocess.run([str(VLLM_PYTHON), "-P", "-c", LAYOUT_PROBE], capture_output=True, text=True, check=True,
                         env=vllm_env(), cwd=tmp_path, timeout=120).stdout.strip().splitlines()
    assert out[-3:] == ["('', '') False", "auto False", "fp8 True"]
