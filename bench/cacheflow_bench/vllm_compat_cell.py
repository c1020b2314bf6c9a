"""One cell of the vLLM compatibility matrix: a tiny checkpoint of one family in one fresh vLLM process
(TP or PP, KV cache dtype, LoRA on or off) with the CacheFlow connector over its own storage pod.

The connector plans with a profile whose costs make a chunk's recompute on these tiny models about as dear
as its load (`COSTS`), so every restore runs CacheFlow's own policy with both pointers moving (its
recompute beside vLLM, tensor-parallel ranks' planned fronts included), not Cake's no-profile fallback.

The prompts run in passes, the connector's saves flushed and vLLM's prefix cache reset between passes:
without LoRA a cold pass (vLLM computes; the connector stores the chunks: the reference) then a warm one
(the connector restores or declines). With LoRA: the adapter cold (its reference), the base model while only
the adapter's chunks are stored (any restore there used another adapter's chunks: a leak), then both warm.
A later pass's greedy tokens must equal its reference pass's. When vLLM with the connector fails, vLLM runs
once without it to tell vLLM's own failure (`vllm_cannot_run`) from the connector's (`failed`).

A sharing cell (`stored_by`: another tensor-parallel size) runs two processes over its pod: vLLM at TP
`stored_by` makes the cold pass (its ranks store the chunks, each its own KV heads), then vLLM at the cell's TP
makes the "shared" pass, which restores from those chunks (its ranks take their heads out of the other split's
objects): its tokens must equal the cold pass's.

A speculative-decoding cell (`spec`) runs vLLM with a draft: n-gram lookup or Medusa heads (no KV of their own:
the connector serves them), an EAGLE or EAGLE-3 head, the model's own MTP layer (MiMo's, GLM-4.5's) or a draft
model (KV of their own, which the connector restores by rerunning the draft). The draft model is the target
itself: it drafts the target's own greedy tokens, so a wrong draft KV shows in how many vLLM accepts (vLLM
resolves a model with MTP layers, drafting for itself, to those layers: `method='mtp'`). Its prompts repeat a
random stretch, so the n-gram lookup finds matches and drafts; vLLM's draft counters for the last pass are kept
(a draft's tokens are verified by the target model: greedy tokens must still be equal), and whether they equal
the cold pass's (`drafts_as_cold`: vLLM drafted and accepted after the restore exactly as after its own
prefill).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cacheflow_bench import tiny_models
from cacheflow_bench.common import machine_facts
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.profile import Crossover, Profile
from cacheflow_services.storage.launch import launch_pod, write_tokens
from cacheflow_services.vllm_connector.drive_process import TIMED_OUT, run_drive

CHUNK, BLOCK = 64, 32  # CacheFlow chunk; vLLM block (its CPU attention needs a multiple of 32)
PREFIXES = (256, 320, 448)  # whole chunks per prompt, then SUFFIX tokens vLLM always computes
SUFFIX = 16
MAX_TOKENS = 8
DRIVE_TIMEOUT_S = 300
TAIL_LINES = 15
SPECIFIC_ERROR = re.compile(r"\b\w+Error(: |$)")
ERROR = re.compile(r"(Error|error|Exception)[:,]")
TENANT = "compat"
BASE_PASSES = (("cold", False), ("warm", False))  # (label, with the adapter), in order
SHARE_PASSES = (("cold", False), ("shared", False))  # the first by the storing process, the second by the cell's
LORA_PASSES = (("lora-cold", True), ("base-after-lora", False), ("lora-warm", True), ("base-warm", False))
REFERENCE = {"warm": "cold", "lora-warm": "lora-cold", "base-warm": "base-after-lora",
             "shared": "cold"}  # pass -> its reference
LEAK_PASS = "base-after-lora"
SPEC_DRAFTS = ("ngram", "medusa", "eagle", "eagle3", "mtp", "draft_model")  # two drafts without KV of their own
# the families with tiny draft checkpoints, per draft that has one (vLLM's EagleLlamaForCausalLM reads an EAGLE
# draft of a Llama; Medusa heads fit any family, run on one); an MTP draft is the model's own layer
DRAFT_FAMILIES = {"medusa": ("llama",), "eagle": ("llama",), "eagle3": ("llama",),
                  "mtp": tuple(sorted(tiny_models.MTP_FAMILIES))}
SPEC_TOKENS = 3  # draft tokens per step
PERIOD = 24  # a speculative cell's prompts repeat a stretch of this many tokens
SPEC_MAX_TOKENS = 32  # a speculative cell's greedy tokens per prompt: enough for a draft to find matches


# Per layer, a 64-token chunk's recompute takes about 0.3 ms; a chunk's load 1 ms, whatever its bytes: on 2-4
# layers, recompute and load are within a factor of 2 of each other, so the split falls inside the prefix.
COSTS = CostModel(chunk_compute=LinearCost(fixed_s=1e-4, per_token_s=3e-6, per_token_ctx_s=0.0),
                  layer_compute=LinearCost(fixed_s=1e-4, per_token_s=3e-6, per_token_ctx_s=0.0),
                  load=LoadCost(bytes_per_s=1e12, latency_s=1e-3))


def write_profile(path: Path) -> Path:
    """The cells' profile (`COSTS`; token-wise at every length: vLLM's model restores token-wise)."""
    Profile(model="tiny", model_name="vllm-compat tiny checkpoints", dtype="float32", chunk_size=CHUNK, threads=1,
            costs=COSTS, crossovers=(Crossover(link_bytes_per_s=1e12, l_delta=0),)).save(path)
    return path


def fixed_plan(path: Path) -> dict[str, Any]:
    """Connector settings that plan with the cells' profile (written to `path`) as it is: its costs are written to
    put the split inside the prefix, not measured, so the planned restores must not learn what loads and recompute
    really take (on these tiny models they would soon recompute every chunk and load none)."""
    return {"profile": str(write_profile(path)), "calibrate": False}


@dataclass(frozen=True)
class Cell:
    family: str
    tp: int
    kv_dtype: str
    lora: bool
    stored_by: int = 0  # the TP size whose process stored the chunks this cell restores (0: this cell's own)
    pp: int = 1  # pipeline-parallel size
    spec: str = ""  # speculative decoding's draft (SPEC_DRAFTS), or none

    @property
    def name(self) -> str:
        shared = f"-from-tp{self.stored_by}" if self.stored_by else ""
        pipeline = f"-pp{self.pp}" if self.pp > 1 else ""
        draft = f"-{self.spec}" if self.spec else ""
        return f"{self.family}-tp{self.tp}{pipeline}-{self.kv_dtype}-{'lora' if self.lora else 'base'}{shared}{draft}"

    @property
    def passes(self) -> tuple[tuple[str, bool], ...]:
        """(label, with the adapter) of each pass, in order; the last's outcome is the cell's."""
        return SHARE_PASSES if self.stored_by else LORA_PASSES if self.lora else BASE_PASSES


def prompts(repeating: bool = False) -> list[list[int]]:
    """One random prompt per prefix length; `repeating`: each a random stretch of PERIOD tokens over and over."""
    rng = random.Random(0)
    if not repeating:
        return [[rng.randrange(tiny_models.VOCAB) for _ in range(n + SUFFIX)] for n in PREFIXES]
    stretches = [[rng.randrange(tiny_models.VOCAB) for _ in range(PERIOD)] for _ in PREFIXES]
    return [[stretch[i % PERIOD] for i in range(n + SUFFIX)] for n, stretch in zip(PREFIXES, stretches, strict=True)]


def model_dirs(root: Path, family: str) -> tuple[Path, Path]:
    """Where the family's tiny checkpoint and its LoRA adapter are (see `make_models`)."""
    return root / "models" / family, root / "models" / f"{family}-lora"


def draft_dir(model: Path, draft: str) -> Path:
    """Where the `draft` checkpoint (DRAFT_FAMILIES) of the tiny checkpoint at `model` is."""
    return model.with_name(f"{model.name}-{draft}")


def has_draft(family: str, spec: str) -> bool:
    """Whether a speculative cell can run: its draft needs no checkpoint, or the family has one."""
    return family in DRAFT_FAMILIES.get(spec, (family,))


def make_models(root: Path, families: list[str]) -> None:
    """Each family's tiny checkpoint, LoRA adapter and draft checkpoints (DRAFT_FAMILIES) under root/models,
    made afresh."""
    savers = {"medusa": tiny_models.save_medusa, "eagle": tiny_models.save_eagle, "eagle3": tiny_models.save_eagle3}
    for family in families:
        model, adapter = model_dirs(root, family)
        tiny_models.save(family, model)
        tiny_models.save_lora(family, model, adapter)
        for draft, save in savers.items():
            if family in DRAFT_FAMILIES[draft]:
                save(family, draft_dir(model, draft))


def speculative_config(cell: Cell, model: Path) -> dict[str, Any] | None:
    """vLLM's speculative decoding settings for the cell, or None."""
    if cell.spec == "ngram":
        return {"method": "ngram", "num_speculative_tokens": SPEC_TOKENS, "prompt_lookup_min": 1,
                "prompt_lookup_max": 4}
    if cell.spec == "mtp":  # the model's own layer
        return {"method": "mtp", "num_speculative_tokens": SPEC_TOKENS}
    if cell.spec in DRAFT_FAMILIES:
        return {"method": cell.spec, "model": str(draft_dir(model, cell.spec)), "num_speculative_tokens": SPEC_TOKENS}
    if cell.spec == "draft_model":  # the target drafts for itself
        return {"method": "draft_model", "model": str(model), "num_speculative_tokens": SPEC_TOKENS}
    return None


def drive(spec: dict[str, Any], root: Path, name: str) -> tuple[dict[str, Any] | None, str]:
    """Run drive.py on `spec` in a fresh vLLM process: what it wrote (None if it failed) and its log."""
    run = run_drive(spec, root, name, timeout_s=DRIVE_TIMEOUT_S)
    return run.result, run.log


def spec_for(cell: Cell, model: Path, adapter: Path, connector: dict[str, Any] | None) -> dict[str, Any]:
    """The cell's vLLM run (a sharing cell's second process: its first runs with `storing_spec`)."""
    passes = cell.passes[1:] if cell.stored_by else cell.passes
    return {"model": str(model), "dtype": tiny_models.RUN_DTYPE.get(cell.family, "float32"),
            "prompts": prompts(repeating=bool(cell.spec)), "speculative_config": speculative_config(cell, model),
            "max_tokens": SPEC_MAX_TOKENS if cell.spec else MAX_TOKENS, "ignore_eos": True,
            "block_size": BLOCK, "max_model_len": 1024, "tensor_parallel_size": cell.tp,
            "pipeline_parallel_size": cell.pp,
            "kv_cache_dtype": cell.kv_dtype, "enable_lora": cell.lora, "connector": connector,
            "passes": [{"label": label, "lora": str(adapter) if with_adapter else None}
                       for label, with_adapter in passes]}


def run_cell(cell: Cell, root: Path) -> dict[str, Any]:
    """The cell's record: status (ok / failed / vllm_cannot_run), start-up, tokens, the connector's outcome."""
    started = time.perf_counter()
    work = root / cell.name
    shutil.rmtree(work, ignore_errors=True)  # an empty pod: no chunk of an earlier run may be restored
    work.mkdir(parents=True)
    model, adapter = model_dirs(root, cell.family)
    stats = work / "stats.jsonl"
    pod = launch_pod(work / "pod", tenants=(TENANT,), tokens=write_tokens(work / "tokens", [TENANT]))
    try:
        connector = {"pods": [f"pod-0=127.0.0.1:{pod.data_port}"], "tenant": TENANT,
                     "pod_token_file": str(work / "tokens"), "chunk_size": CHUNK, "stats_file": str(stats),
                     **fixed_plan(work / "profile.json")}
        result, log = drive_cell(cell, work, spec_for(cell, model, adapter, connector))
    finally:
        pod.stop()
    record = {**asdict(cell), "name": cell.name, "commit": machine_facts()["git"]}
    if result is None:
        record |= without_connector(cell, work, model, adapter, log)
    else:
        record |= judge(cell, result, read_events(stats))
    return {**record, "wall_s": round(time.perf_counter() - started, 1)}


def drive_cell(cell: Cell, work: Path, spec: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The cell's run: one process, or for a sharing cell the storing process's then the cell's, their results
    (pass after pass) and logs joined."""
    if not cell.stored_by:
        return drive(spec, work, "connector")
    storing = {**spec, "tensor_parallel_size": cell.stored_by, "passes": [{"label": cell.passes[0][0]}]}
    stored, log = drive(storing, work, "storing")
    if stored is None:
        return None, log
    result, more = drive(spec, work, "connector")
    joined = None if result is None else {**result, "results": stored["results"] + result["results"]}
    return joined, f"{log}\n{more}"


def without_connector(cell: Cell, work: Path, model: Path, adapter: Path, connector_log: str) -> dict[str, Any]:
    """vLLM with the connector failed: whose failure it is, from one run without the connector."""
    spec = spec_for(cell, model, adapter, None)
    plain, log = drive({**spec, "passes": spec["passes"][:1]}, work, "plain")
    if plain is None:
        return {"status": "vllm_cannot_run", "start_ok": False, "error": error_line(log), "log_tail": tail(log)}
    return {"status": "failed", "start_ok": False,
            "error": f"vLLM starts without the connector; with it: {error_line(connector_log)}",
            "log_tail": tail(connector_log)}


def tail(log: str) -> str:
    return "\n".join(log.splitlines()[-TAIL_LINES:])


def error_line(log: str) -> str:
    """The line of a failed run's log that says what went wrong: the last exception with a specific class, a
    rank worker's first (the engine's report of it, or the driver's error once the engine is gone, comes
    after), else the last line naming an error, else the last; with the timeout, where the run then hung (a
    rank that failed leaves the others waiting)."""
    lines = [x.strip() for x in log.splitlines() if x.strip() and " WARNING " not in x]  # warnings are no cause
    timed_out = next((x for x in reversed(lines) if x.startswith(TIMED_OUT)), "")
    workers = [x for x in lines if x.startswith("(Worker")]
    for pattern, among in ((SPECIFIC_ERROR, workers), (SPECIFIC_ERROR, lines), (ERROR, lines)):
        if named := [x for x in among if pattern.search(x) and not x.startswith(TIMED_OUT)]:
            found = with_assertion(named[-1], among)
            return f"{found} ({timed_out})" if timed_out else found
    return timed_out or (lines[-1] if lines else "")


def with_assertion(line: str, lines: list[str]) -> str:
    """A bare `AssertionError` with the assert statement its traceback shows just before it."""
    if not line.endswith("AssertionError"):
        return line
    before = lines[: len(lines) - lines[::-1].index(line) - 1]
    statement = next((x for x in reversed(before) if "assert " in x), "")
    return f"{line}: {statement.split('assert ', 1)[1]}" if statement else line


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def pass_of(request_id: str, labels: list[str]) -> str | None:
    """The pass a request belongs to: drive.py names requests `{label}-{n}` (vLLM may add a suffix)."""
    return next((label for label in sorted(labels, key=len, reverse=True) if request_id.startswith(f"{label}-")),
                None)


def outcome(events: list[dict[str, Any]]) -> dict[str, Any]:
    """restored (with computed and loaded totals) if a restore used stored chunks; else declined with the
    reasons if the connector declined or stepped aside; else none."""
    restores = [e for e in events if e["event"] == "restore" and e.get("computed", 0) + e.get("loaded", 0) > 0]
    if restores:
        return {"outcome": "restored", "computed": sum(e["computed"] for e in restores),
                "loaded": sum(e["loaded"] for e in restores)}
    reasons = sorted({e.get("reason", "?") for e in events if e["event"] in ("inactive", "declined")})
    return {"outcome": "declined", "reasons": reasons} if reasons else {"outcome": "none"}


def last_pass_drafts(counts: list[dict[str, int]]) -> dict[str, int]:
    """vLLM's draft counters over the last pass (`counts`: as they stood after each pass)."""
    before = counts[-2] if len(counts) > 1 else {}
    return {name: value - before.get(name, 0) for name, value in counts[-1].items()
            if name in ("drafts", "draft_tokens", "accepted_tokens")}


def judge(cell: Cell, result: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pass its tokens and the connector's outcome; the cell's status from them."""
    labels = [label for label, _ in cell.passes]
    n = len(PREFIXES)
    tokens = {label: [r["tokens"] for r in result["results"][i * n:(i + 1) * n]] for i, label in enumerate(labels)}
    inactive = [e for e in events if e["event"] == "inactive"]
    per_pass = {label: outcome(inactive + [e for e in events if pass_of(str(e.get("req", "")), labels) == label])
                for label in labels}
    equal = all(tokens[later] == tokens[ref] for later, ref in REFERENCE.items() if later in tokens)
    errors = [e for e in events if e["event"] == "load_error"]
    record: dict[str, Any] = {"start_ok": True, "startup_s": round(result["startup_s"], 1), "tokens_equal": equal,
                              **per_pass[labels[-1]], "passes": per_pass, "load_errors": len(errors),
                              "saved_chunks": sum(e.get("chunks", 0) for e in events if e["event"] == "save")}
    if cell.spec:
        warm = last_pass_drafts(result["spec_decode"])
        record |= warm | {"drafts_as_cold": warm == last_pass_drafts(result["spec_decode"][:1])}  # the cold pass's
    if cell.lora:
        record["lora_leak"] = per_pass[LEAK_PASS]["outcome"] == "restored"
        record["adapter_changes_tokens"] = tokens["lora-cold"] != tokens[LEAK_PASS]
        record["base_tokens"] = tokens[LEAK_PASS]
    else:
        record["base_tokens"] = tokens["cold"]
    failed = not equal or errors or record.get("lora_leak")
    return {"status": "failed" if failed else "ok", **record}
