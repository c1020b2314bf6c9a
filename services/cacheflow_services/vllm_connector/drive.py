"""Run prompts through vLLM (offline, in this process), with or without the CacheFlow connector.

    python -m cacheflow_services.vllm_connector.drive run.json

run.json: {"model": dir, "prompts": [[token ids], ...], "max_tokens": 8, "out": path,
           "connector": {extra config} or null, "reference_connector": a folder or null,
           "max_model_len": 4096, "dtype": "float32", "prefix_caching": false,
           "block_size": 128, "max_num_batched_tokens": vLLM's default, "long_prefill_token_threshold": vLLM's
           default, "kv_cache_dtype": "auto",
           "batches": [[prompt indices submitted together], ...] (default: each prompt alone, in order),
           "cache_salts": [a prompt's cache_salt or null, ...] (default: none),
           "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "enable_lora": false, "max_loras": 1,
           "ignore_eos": false, "speculative_config": vLLM's speculative decoding settings or null,
           "passes": [{"label": "cold", "lora": adapter dir or null, "loras": [per prompt: adapter dir or null]},
                      ...] (default: one pass, no adapter; "loras" overrides "lora"),
           "late": [prompt indices] (default: none), "late_after_tokens": 4, "memory": false}

Writes to `out`: per prompt the greedy tokens, their logprobs and the request's wall time (with
max_tokens=1 that is its TTFT; measured from its batch's submission), when its first token came and when each
token came (`token_times_s`), and the engine's start-up time; with `memory`, each process's resident memory at
the end (`process_memory`: this one and every rank's worker). Batches run one after another; the prompts of a
batch arrive together, except `late` ones: each is submitted once every other prompt of its batch has
`late_after_tokens` tokens (or finished), as a request arriving while the others decode, and its times count
from its own submission (`submitted_s` after the batch's). With
`passes`, all batches run once per pass, the connector's saves flushed and vLLM's prefix cache reset between
passes (so a later pass goes to the connector); `results` then holds every pass's prompts, pass after pass,
each with its `request_id` (`{label}-{n}`: the connector's stats name requests by it). `reference_connector`
(instead of `connector`) runs vLLM's own reference connector, `ExampleConnector`, storing KV under that
folder: what any KV connector costs vLLM, for comparison.
With `speculative_config`, `spec_decode` holds vLLM's draft counters (drafts, draft_tokens, accepted_tokens)
as they stood after each pass.
Run it with vLLM's Python (its own virtual environment); it waits for the connector's saves before exiting.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

CONNECTOR_MODULE = "cacheflow_services.vllm_connector.connector"
LATE_AFTER_TOKENS = 4


def transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "CacheFlowConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def spec_transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The KV transfer config a run spec asks for: CacheFlow's connector, vLLM's reference one, or none."""
    if spec.get("connector") is not None:
        return transfer_config(spec["connector"])
    if spec.get("reference_connector"):
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": spec["reference_connector"]}}
    return None


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: starts faster
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # `_flush_saves` sent to TP workers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    started = time.perf_counter()
    extra = spec.get("connector")  # CacheFlow's settings, or None
    # the scheduler's token budget per step (vLLM's default on CPU: 4,096, so a longer prompt is prefilled in chunks),
    # and the most of it one request's prefill takes while others run (vLLM's default: no limit)
    budget = {key: spec[key] for key in ("max_num_batched_tokens", "long_prefill_token_threshold") if key in spec}
    slots = {"max_loras": spec.get("max_loras", 1)} if spec.get("enable_lora") else {}
    pipeline = spec.get("pipeline_parallel_size", 1)
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True, seed=0,
              max_model_len=spec.get("max_model_len", 4096), **_execution(pipeline),
              enable_prefix_caching=spec.get("prefix_caching", False), block_size=spec.get("block_size", 128),
              **budget, tensor_parallel_size=spec.get("tensor_parallel_size", 1), pipeline_parallel_size=pipeline,
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), enable_lora=spec.get("enable_lora", False), **slots,
              kv_transfer_config=spec_transfer_config(spec), speculative_config=spec.get("speculative_config"),
              disable_log_stats=not spec.get("speculative_config"))
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=1,
                            ignore_eos=spec.get("ignore_eos", False))
    salts = spec.get("cache_salts") or [None] * len(spec["prompts"])
    prompts = [TokensPrompt(prompt_token_ids=ids, **({"cache_salt": salt} if salt else {}))
               for ids, salt in zip(spec["prompts"], salts, strict=True)]
    results: list[dict[str, Any]] = []
    adapters: dict[str, int] = {}  # adapter dir -> its LoRA id, the same in every pass
    drafts: list[dict[str, int]] = []  # with speculative decoding: its counters after each pass
    for n, one in enumerate(spec.get("passes") or [{"label": "drive"}]):
        if n:
            _between_passes(llm, extra is not None)
        paths = one.get("loras") or [one.get("lora")] * len(prompts)
        loras = [LoRARequest(Path(path).name, adapters.setdefault(path, 1 + len(adapters)), path) if path else None
                 for path in paths]
        late = Late(set(spec.get("late", ())), spec.get("late_after_tokens", LATE_AFTER_TOKENS))
        results += _one_pass(llm.llm_engine, prompts, params, spec.get("batches"), one["label"], loras, late)
        if spec.get("speculative_config"):
            drafts.append(_draft_counts(llm))
    if extra is not None:
        llm.collective_rpc(_flush_saves)
    out: dict[str, Any] = {"startup_s": startup_s, "results": results}
    if drafts:
        out["spec_decode"] = drafts
    if spec.get("memory"):
        ranks = llm.collective_rpc(process_memory)
        out["memory"] = list({m["pid"]: m for m in [process_memory(), *ranks]}.values())  # a rank may be this process
    return out


def _execution(pipeline: int) -> dict[str, Any]:
    """Eager, except under pipeline parallelism: vLLM's CPU worker skips its warm-up run when eager, and a rank
    after the first then has no buffer for what the rank before sends (`assert self.intermediate_tensors is
    not None` at its first step); torch.compile's warm-up allocates it."""
    return {"enforce_eager": True} if pipeline == 1 else {"compilation_config": {"mode": 1}}  # STOCK_TORCH_COMPILE


def _draft_counts(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters so far: drafts, draft tokens and accepted tokens."""
    prefix = "vllm:spec_decode_num_"
    return {m.name.removeprefix(prefix): int(m.value) for m in llm.get_metrics()
            if m.name.startswith(prefix) and hasattr(m, "value")}


class Late(NamedTuple):
    prompts: set[int]  # prompt indices submitted once the rest of their batch decodes
    after_tokens: int  # ... and every other request of the batch has this many tokens (or finished)


def _one_pass(engine: Any, prompts: list[Any], params: Any, batches: list[list[int]] | None, label: str,
              loras: list[Any], late: Late) -> list[dict[str, Any]]:
    """Every prompt once (each under its LoRA request, or none), batch after batch; the results in prompt
    order."""
    results: list[dict[str, Any]] = [{} for _ in prompts]
    for batch in batches or [[i] for i in range(len(prompts))]:
        arrives_late = [i in late.prompts for i in batch]
        for i, result in zip(batch, _together(engine, [prompts[i] for i in batch], params, label,
                                              [loras[i] for i in batch], arrives_late, late.after_tokens),
                             strict=True):
            results[i] = result
    return results


def _between_passes(llm: Any, connector: bool) -> None:
    """The connector's saves finished on every worker, vLLM's own prefix cache empty."""
    if connector:
        llm.collective_rpc(_flush_saves)
    llm.reset_prefix_cache()


def _together(engine: Any, prompts: list[Any], params: Any, label: str = "drive", loras: list[Any] | None = None,
              late: list[bool] | None = None, after_tokens: int = 0) -> list[dict[str, Any]]:
    """Submit `prompts` at once (those marked `late` once the others have `after_tokens` tokens) and step vLLM's
    engine until every one is done: per prompt its greedy tokens, their logprobs, when each token came
    (`token_times_s`), the first (`first_token_s`) and when it finished (`wall_s`), in seconds since the
    batch's submission (a late prompt: since its own, which came `submitted_s` after the batch's)."""
    start = time.perf_counter()
    late = late or [False] * len(prompts)
    ids = [f"{label}-{next(_REQUEST_IDS)}" for _ in prompts]
    origin: dict[str, float] = {}  # request -> when its times count from, since `start`
    times: dict[str, list[float]] = {request_id: [] for request_id in ids}  # each token's arrival, since `start`
    done: dict[str, dict[str, Any]] = {}

    def submit(i: int) -> None:
        origin[ids[i]] = time.perf_counter() - start if late[i] else 0.0
        engine.add_request(ids[i], prompts[i], params, lora_request=loras[i] if loras else None)

    for i in range(len(prompts)):
        if not late[i]:
            submit(i)
    while len(done) < len(ids):
        if len(origin) < len(ids) and all(len(times[r]) >= after_tokens or r in done for r in origin):
            for i in range(len(prompts)):
                if late[i]:
                    submit(i)
        for out in engine.step():
            now = time.perf_counter() - start
            seen = times[out.request_id]
            seen += [now] * (len(out.outputs[0].token_ids) - len(seen) if out.outputs else 0)
            if out.finished:
                completion, t0 = out.outputs[0], origin[out.request_id]
                logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs or [], completion.token_ids,
                                                           strict=True)]
                done[out.request_id] = {"tokens": list(completion.token_ids), "logprobs": logprobs,
                                        "wall_s": now - t0, "first_token_s": (seen[0] if seen else now) - t0,
                                        "token_times_s": [t - t0 for t in seen], "submitted_s": t0,
                                        "request_id": out.request_id}
    return [done[request_id] for request_id in ids]


_REQUEST_IDS = itertools.count()


def process_memory(worker: Any = None) -> dict[str, int]:
    """This process's resident memory from /proc/self/status, in bytes: VmRSS, its peak (VmHWM), anonymous and
    file-backed; then VmRSS again after `malloc_trim(0)` hands the heap's freed pages back, and the bytes the
    heap holds for live allocations (`heap_in_use_bytes`: glibc's `mallinfo2`, its arenas' in-use bytes plus
    its mmapped chunks; 0 where the C library has none). The trimmed RSS still holds freed memory the
    allocator keeps (the free top of a thread's own arena, which `malloc_trim` leaves); the heap in use does
    not; and how many Python modules the process has loaded (where the fixed costs come from)."""
    import ctypes

    def status() -> dict[str, int]:
        lines = Path("/proc/self/status").read_text().splitlines()
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines if ":" in line)
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

    libc = ctypes.CDLL("libc.so.6")
    before = status()
    libc.malloc_trim(0)
    return {"pid": os.getpid(), "rss_bytes": before["VmRSS"], "peak_rss_bytes": before["VmHWM"],
            "anon_rss_bytes": before["RssAnon"], "file_rss_bytes": before["RssFile"],
            "trimmed_rss_bytes": status()["VmRSS"], "heap_in_use_bytes": _heap_in_use(libc),
            "python_modules": len(sys.modules)}


def _heap_in_use(libc: Any) -> int:
    """glibc's heap bytes in live allocations: `mallinfo2`'s uordblks (its arenas') plus hblkhd (mmapped)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = getattr(libc, "mallinfo2", None)  # glibc 2.33 and later
    if mallinfo2 is None:
        return 0
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _flush_saves(worker: Any = None) -> None:
    """Wait for the connector's saves on this process (`worker`: what `collective_rpc` passes)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        get_kv_transfer_group().flush()


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
