"""The README's benchmark table, generated from the benchmarks' JSON results by `cacheflow bench report`.

One row per benchmark whose results exist, its numbers read from the result's summary (Cake beside
CacheFlow wherever the result has it). A key that an older result lacks reads `n/a (rerun COMMAND)`.
The table replaces the README's lines between BEGIN and END; a line under it names the commit the
results come from, or warns that they come from several.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cacheflow_bench.batch_report import aggregate

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- benchmark-table:begin -->"
END = "<!-- benchmark-table:end -->"
COMMANDS = {"restore_single": "cacheflow bench restore", "storage": "cacheflow bench storage",
            "latency": "cacheflow bench latency", "stages": "cacheflow bench stages", "batch": "cacheflow bench batch",
            "sched_scale": "cacheflow bench sched-scale", "chaos": "cacheflow bench chaos",
            "vllm": "cacheflow bench vllm", "vllm_memory": "python -m cacheflow_bench.vllm_memory",
            "vllm_stall": "cacheflow bench vllm-stall", "vllm_eagle": "cacheflow bench vllm-eagle",
            "vllm_draft_model": "cacheflow bench vllm-eagle --draft draft_model",
            "vllm_stall_eagle": "cacheflow bench vllm-stall --draft eagle",
            "vllm_stall_step256": "cacheflow bench vllm-stall --step-tokens 256",
            "vllm_stall_eagle_step256": "cacheflow bench vllm-stall --draft eagle --step-tokens 256"}
Results = dict[str, dict[str, Any]]
DRAFT_NAMES = {"eagle": "EAGLE draft", "draft_model": "draft model"}  # a speculative method's draft, in words


def num(x: float) -> str:
    """x to 3 significant digits (2 past 100), without an exponent."""
    if x == 0 or not math.isfinite(x):
        return str(x)
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def commit_of(body: dict[str, Any]) -> str | None:
    return body.get("machine", {}).get("git") or None


def commit_problems(results: Results) -> list[str]:
    """`name.json: commit` for every result, when they are not all of one clean commit; else nothing."""
    commits = {name: commit_of(body) for name, body in results.items()}
    clean = {c for c in commits.values() if c and not c.endswith("-dirty")}
    if len(clean) <= 1 and all(c in clean for c in commits.values()):
        return []
    return [f"{name}.json: {commit or 'no commit recorded'}" for name, commit in commits.items()]


class Row:
    """A row's headline: numbers from one result's summary, `n/a (rerun ...)` for keys it lacks."""

    def __init__(self, name: str, body: dict[str, Any]) -> None:
        self.name, self.body, self.summary = name, body, body.get("summary", {})
        self.missing = f"n/a (rerun `{COMMANDS[name]}`)"

    def get(self, key: str, fmt: Callable[[Any], str] = num) -> str:
        value = self.summary.get(key)
        return self.missing if value is None else fmt(value)

    def times(self, key: str) -> str:
        return self.get(key, lambda v: f"{num(v)}×")


def restore_row(r: Row) -> tuple[str, str]:
    s = r.summary
    vs_cake = s.get("cacheflow_vs_cake_at_balance")
    loses = " (**CacheFlow does not beat Cake**)" if vs_cake is not None and vs_cake >= 1 else ""
    resolvable = s.get("within_bound_resolvable")
    spread = (f"T*'s run-to-run spread {r.get('bound_spread')}" if resolvable is not False
              else f"not resolvable: T* itself varies by {r.get('bound_spread')}")
    headline = (f"At Tio/Tcomp = 1, median over prefix lengths: CacheFlow / Cake "
                f"**{r.get('cacheflow_vs_cake_at_balance')}**{loses}; CacheFlow / the better of compute-only and "
                "load-only "
                f"**{r.get('ratio_to_best_baseline_at_balance')}**, Cake / the same "
                f"{r.get('cake_to_best_baseline_at_balance')} (the bound is 0.5). Worst restore time / the optimal "
                f"bound T* over {s.get('cells', '?')} cells: CacheFlow {r.get('max_ratio_to_bound')}, Cake "
                f"{r.get('max_cake_ratio_to_bound')} ({spread}). Adaptive regret {r.get('max_adaptive_regret')}")
    t = s.get("targets", {})
    target = (f"CacheFlow / better mode ≤ {t.get('ratio_to_best_baseline_at_balance', 0.6)}; worst / T* ≤ "
              f"{t.get('max_ratio_to_bound', 1.15)}; regret ≤ {t.get('max_adaptive_regret', 0.1)}")
    return headline, target


def storage_row(r: Row) -> tuple[str, str]:
    worst: dict[str, float] = {}
    for x in r.body.get("shaping", []):
        if x.get("sustainable"):
            worst[x["transport"]] = max(worst.get(x["transport"], 0.0), x["error"])
    per = ", ".join(f"{num(100 * e)} % over {t.upper()}" for t, e in worst.items()) or r.missing
    headline = (f"one loader into a KV buffer, unshaped loopback, worst of 1–64 MB: TCP "
                f"**{r.get('loader_gb_per_s_tcp')} GB/s** (plain loopback TCP with no CacheFlow code: "
                f"{r.get('socket_ceiling_gb_per_s')} GB/s), NIXL / TCP {r.times('nixl_vs_tcp_throughput_min')}; "
                f"CPU per GB, pod and loader: worst "
                f"**{r.get('cpu_s_per_gb_end_to_end_max')} s**, {r.times('cpu_per_gb_over_memcpy_max')} a memcpy's "
                f"({r.get('memcpy_cpu_s_per_gb')} s; plain TCP {r.get('socket_ceiling_cpu_s_per_gb')} s); an idle "
                f"pod {r.get('idle_pod_cpu_share_max', _percent)} of a core; worst shaped-rate error at the rates a "
                f"link sustains: {per} (all rates: {r.get('max_shaping_error_all_rates', _percent)})")
    return headline, "≥ 5 GB/s; NIXL ≥ TCP; ≤ 3× memcpy; idle ≤ 2 %; ≤ 5 %"


def latency_row(r: Row) -> tuple[str, str]:
    ms = lambda key: r.get(key, lambda v: f"{num(v)} ms")  # noqa: E731
    before = r.body.get("before", {}).get("summary", {})
    was = (f" (before, {r.body['before']['git']}: round trip {num(before['http_round_trip_ms_max'])} ms, fixed cost "
           f"{num(before['lone_restore_fixed_cost_ms'])} ms, decode {num(before['decode_ms_per_token'])} ms)"
           if before else "")
    return (f"tiny-model local cluster: slowest service's keep-alive round trip **{ms('http_round_trip_ms_max')}**; a "
            f"lone restore's fixed cost **{ms('lone_restore_fixed_cost_ms')}** (restore {ms('lone_restore_ms')}, "
            f"TTFT {ms('lone_ttft_ms')}); decode {ms('decode_ms_per_token')} per token{was}; with TLS on the internal "
            f"hops: {ms('tls_http_round_trip_ms_max')}, {ms('tls_lone_restore_fixed_cost_ms')}, "
            f"{ms('tls_decode_ms_per_token')}", "round trip ≤ 2 ms; fixed cost ≤ 5 ms")


def sched_scale_row(r: Row) -> tuple[str, str]:
    ms = lambda key: r.get(key, lambda v: f"{num(v)} ms")  # noqa: E731
    return (f"512 concurrent restores × 64 units: compute pick median **{ms('compute_pick_median_ms_512x64')}**, P99 "
            f"{ms('compute_pick_p99_ms_512x64')}; channel pick median {ms('channel_pick_median_ms_512x64')}; cost ∝ "
            f"n^{r.get('growth_exponent_compute')}; decisions identical to the old scheduler's: "
            f"{r.get('decisions_identical', str)}; simulator, 10,000 requests: {r.get('sim_wall_s_10000')} s; "
            f"scheduler's share of an engine step at 128 restores: {r.get('engine_sched_share_max', _percent)}",
            "≤ 0.5 ms, ≤ 2 ms; ≤ 0.1 ms; ≤ n^1.2; true; ≤ 20 s; < 10 %")


def _percent(x: float) -> str:
    return f"{num(100 * x)} %"


def stages_row(r: Row) -> tuple[str, str]:
    return (f"S = 2 from boundary activations vs S = 1: {r.times('speedup_s2_vs_s1')} faster; vs pipelined: "
            f"{r.times('speedup_s2_vs_pipelined')}; vs sequential: {r.times('speedup_s2_vs_sequential')}; boundary "
            f"bytes stored / KV bytes {r.get('boundary_bytes_share')}", "≥ 1.5× vs pipelined")


POLICIES = (("cacheflow", "CacheFlow"), ("cake", "Cake"), ("load-only", "load-only"), ("compute-only", "compute-only"))


def batch_row(r: Row) -> tuple[str, str]:
    s, runs = r.summary, r.body.get("runs", [])
    batch = s.get("batch", max((x["batch"] for x in runs), default=0))
    means = {a["policy"]: a["mean_s"] for a in aggregate(runs) if a["batch"] == batch}
    repeats = statistics.median(a["repeats"] for a in aggregate(runs) if a["batch"] == batch) if means else 0
    shown = ", ".join(f"**CacheFlow {num(means[p])} s**" if p == "cacheflow" else f"{label} {num(means[p])} s"
                      for p, label in POLICIES if p in means)
    p99, mean = s.get("p99_ratio_vs_cake_b8"), s.get("mean_ratio_vs_cake_b8")
    loses = [what for what, v in (("mean", mean), ("P99", p99)) if v is not None and v >= 1]
    verdict = f" (**CacheFlow does not beat Cake at {' or '.join(loses)}**)" if loses else ""
    headline = (f"{len(r.body.get('requests', []))} trace requests, 2 stage engines, batch {batch}, mean TTFT "
                f"(median of {repeats:g} runs): {shown or r.missing}. CacheFlow / Cake: mean "
                f"{r.times('mean_ratio_vs_cake_b8')}, P99 {r.times('p99_ratio_vs_cake_b8')}{verdict}; CacheFlow / the "
                f"best baseline ({s.get('best_baseline_b8', '?')}) {r.times('mean_ratio_vs_best_baseline_b8')}; "
                f"compute-only / CacheFlow {r.times('mean_speedup_vs_compute_only_b8')}. Compute loop / channels busy "
                f"{r.get('compute_busy_share_b8')} / {r.get('io_busy_share_b8')} (paper: 0.88 / 0.78). One forward "
                f"over 8 requests' chunks: {r.times('batched_forward_speedup')} the throughput of 8 single ones. "
                f"Simulator vs measured restore time: run means off by up to {r.get('sim_mean_rel_error')}, "
                f"per-request median error {r.get('sim_median_rel_error')}" + sweep_sentence(r))
    targets = "≤ 0.85×; ≤ 0.90×; ≥ 2.0×; ≥ 1.3; ≤ 0.10 and ≤ 0.20"
    if "sweep_worst_mean_ratio_vs_cake" in s:
        targets += "; sweep: ≤ 0.95×, ≤ 1.00×, light ≤ 1.00×, overload median ≤ 0.85× and ≤ 1.15× the bound"
    return headline, targets


def sweep_sentence(r: Row) -> str:
    """The trace sweep's keys (`cacheflow bench sweep` adds them to batch.json), where they are."""
    if "sweep_worst_mean_ratio_vs_cake" not in r.summary:
        return ""
    return (f". Trace sweep (`cacheflow bench sweep`: 6 windows x 3 load levels): CacheFlow / Cake worst mean "
            f"{r.times('sweep_worst_mean_ratio_vs_cake')} and worst slowest request "
            f"{r.times('sweep_worst_max_ratio_vs_cake')} at medium and overload, worst light mean "
            f"{r.times('sweep_light_worst_mean_ratio_vs_cake')}; median at overload "
            f"{r.times('sweep_overload_median_mean_ratio_vs_cake')} Cake's, "
            f"{r.times('sweep_overload_median_mean_ratio_vs_bound')} the batch bound's; simulator error on the "
            f"sweep's means {r.get('sweep_sim_mean_rel_error')}")


def chaos_row(r: Row) -> tuple[str, str]:
    s = r.summary
    failed = r.get("failed_requests", lambda v: str(int(v)))
    runs = 1 + sum(isinstance(p, dict) and "outcomes" in p for p in r.body.get("phases", {}).values())
    replays = f"{runs} replays of {len(r.body.get('requests', []))} trace requests"
    headline = (f"{replays} on a supervised local cluster while a pod is killed, a worker is killed, and a pod and the "
                f"coordinator are abused: **{failed} of {s.get('requests', '?')} requests failed** "
                f"({s.get('worker_kill_in_flight', '?')} in flight on the killed worker), "
                f"{r.get('wrong_answers', _count)} wrong answers, {r.get('leaked_slots', _count)} slots leaked, "
                f"{r.get('lockout_s')} s of lockout for the legitimate tenant, served again "
                f"{r.get('worker_kill_recovery_s')} s after the worker kill, pods' resident memory "
                f"+{r.get('max_rss_growth_mb')} MB, {r.get('bad_requests_not_refused', _count)} bad requests not "
                f"refused; the stage workers, attacked directly ({r.get('worker_api_attacks_sent', _count)} calls: "
                f"every route x every credential class, the forwards saving garbage over stored prefixes), "
                f"{r.get('worker_routes_without_grant', _count)} routes without a grant, accepted "
                f"{r.get('worker_api_unauthenticated_accepted', _count)} without credentials, "
                f"{r.get('worker_api_ungranted_accepted', _count)} with the internal token but no valid grant and "
                f"{r.get('grant_replay_accepted', _count)} replayed grants, and "
                f"{r.get('poisoned_answers', _count)} answers changed after them; strangers' deliveries held "
                f"{r.get('stranger_memory_growth_mb')} MB, slowloris connections closed after "
                f"{r.get('slowloris_open_after_s')} s, {r.get('other_tenant_refused_while_one_fills_pool', _count)} "
                f"requests refused while another tenant filled its pool share, "
                f"{r.get('idle_connection_restore_redone', _count)} restores redone after idle gaps")
    return headline, ("failures only in flight on the killed worker; 0; 0; 0; ≤ 15 s; ≤ 256 MB; 0; 0; 0; 0; 0; 0; "
                      "≤ 16 MB; ≤ 10 s; 0; 0")


def _count(x: float) -> str:
    return str(int(x))


def vllm_row(r: Row) -> tuple[str, str]:
    s = r.summary
    median, least = s.get("cacheflow_vs_cake_median"), s.get("cacheflow_vs_cake_min")
    verdict = ""
    if least is not None and least >= 1:
        verdict = " (**CacheFlow does not beat Cake at any point**)"
    elif median is not None and median >= 1:
        verdict = " (**CacheFlow does not beat Cake at most points**)"
    fastest = r.get("cacheflow_fastest_at_every_ratio", lambda v: "yes" if v else "**no**")
    headline = (f"TTFT for 1k–8k-token prefixes at Tio/Tcomp = 0.5, 1, 2 ({len(r.body.get('rows', []))} points): "
                f"CacheFlow / Cake median **{r.times('cacheflow_vs_cake_median')}**, best "
                f"{r.times('cacheflow_vs_cake_min')}{verdict}; CacheFlow fastest at every point: {fastest}; "
                f"speedup over the better of vLLM's recompute and load-only at its worst point "
                f"{r.times('min_speedup_vs_best_other')}")
    if "connector_recompute_vs_vllm_prefill_max" in s:
        headline += (f". The connector's whole-prefix recompute / vLLM's own prefill, 1k–8k tokens in one process: "
                     f"worst **{r.times('connector_recompute_vs_vllm_prefill_max')}**")
    batch = "vllm_batch_mean_ratio_vs_best_baseline" in s
    if batch:
        mean_loses = s.get("vllm_batch_mean_ratio_vs_cake", 0) >= 1
        verdict = (" (**CacheFlow does not beat Cake here**)" if mean_loses else
                   " (**its P99 does not beat Cake's**)" if s.get("vllm_batch_p99_ratio_vs_cake", 0) >= 1 else "")
        headline += (f". Batch of {len((r.body.get('batch') or {}).get('prefixes', []))} requests (1k–4k-token "
                     f"prefixes) arriving together: CacheFlow mean TTFT / the best baseline's "
                     f"({s.get('vllm_batch_best_baseline', '?')}) "
                     f"**{r.times('vllm_batch_mean_ratio_vs_best_baseline')}**, P99 / Cake's "
                     f"**{r.times('vllm_batch_p99_ratio_vs_cake')}**, mean / Cake's "
                     f"{r.times('vllm_batch_mean_ratio_vs_cake')}"
                     + verdict
                     + ("; restored in the background / in vLLM's step, mean "
                        f"{r.times('vllm_batch_async_vs_sync_mean')}" if "vllm_batch_async_vs_sync_mean" in s else
                        f"; batched / per-request restores {r.times('vllm_batch_batched_vs_per_request')}"))
    sweep = "vllm_rate_sweep_worst_mean_ratio_vs_best_baseline" in s
    if sweep:
        trace = r.body.get("trace") or {}
        headline += (f". {len(trace.get('requests', []))} Mooncake trace requests through vLLM's OpenAI server at "
                     f"{len(trace.get('rates_rps', {}))} request rates: CacheFlow / the better of recompute and "
                     f"load-only, worst mean **{r.times('vllm_rate_sweep_worst_mean_ratio_vs_best_baseline')}**, "
                     f"worst P99 **{r.times('vllm_rate_sweep_worst_p99_ratio_vs_best_baseline')}**")
    targets = "fastest at every point"
    if "connector_recompute_vs_vllm_prefill_max" in s:
        targets += "; recompute ≤ 1.10× vLLM's"
    if batch:
        targets += "; batch ≤ 0.85×, P99 ≤ 0.90× Cake's"
    if sweep:
        targets += "; every rate mean ≤ 0.90×, P99 ≤ 1.00×"
    return headline, targets


def vllm_memory_row(r: Row) -> tuple[str, str]:
    trimmed = r.summary.get("added_trimmed_rss_fraction_of_weights", {})
    raw = r.summary.get("added_rss_fraction_of_weights", {})
    if "connector-vllm" not in trimmed:
        return r.missing, "≤ 1 % of the weights"
    weights = r.body.get("weight_bytes", 0) / 2**30
    over = _over_reference(r.summary.get("connector_vllm_over_reference"))
    headline = (f"vLLM's resident memory added by the connector, as a share of the weights ({weights:.1f} GiB, CPU): "
                f"**{_percent(trimmed['connector-vllm'])}** recomputing with vLLM's own model (after malloc_trim; "
                f"{_percent(raw['connector-vllm'])} raw"
                f"{_heap(r.summary.get('added_heap_in_use_fraction_of_weights', {}).get('connector-vllm'))}{over})"
                "; CacheFlow's runtime over vLLM's weights "
                f"{_percent(trimmed['connector-shared'])}, over a separate copy "
                f"{_percent(trimmed['connector-separate'])}")
    for key, split in r.summary.items():
        if key[:2] in ("tp", "pp") and isinstance(split, dict):
            headline += (f"; a {key[:2].upper()}={key[2:]} instance (all its processes) "
                         f"**{_percent(split['trimmed_rss_bytes'])}** ({_percent(split['rss_bytes'])} raw"
                         f"{_heap(split.get('heap_in_use_bytes'))})"
                         f"{_over_reference(split.get('over_reference'))}")
    return headline, "≤ 1 % of the weights"


def _heap(fraction: float | None) -> str:
    """The heap in use the connector adds (glibc's live allocations), where the run measured it."""
    return "" if fraction is None else f", heap in use {_percent(fraction)}"


def _over_reference(over: dict[str, float] | None) -> str:
    """What the connector adds over vLLM with its own reference connector, where that ran."""
    return f", {_percent(over['trimmed_rss_bytes'])} over vLLM with its reference connector" if over else ""


def drafting(body: dict[str, Any]) -> str:
    """How a vllm-stall result's processes drafted, as a clause ("" without a draft)."""
    return f", every process drafting with a random one-layer {DRAFT_NAMES[body['draft']]}" if body.get("draft") else ""


def chunking(body: dict[str, Any]) -> str:
    """How a vllm-stall result capped one request's prefill per step, as a clause ("" where it did not)."""
    tokens = body.get("step_tokens")
    return (f", one request's prefill capped at {tokens} tokens a step while others run (vLLM's "
            f"long_prefill_token_threshold, in every process), the connector's planned fronts too") if tokens else ""


def vllm_stall_row(r: Row) -> tuple[str, str]:
    target = "the decoders stall less than with the restore in vLLM's step"
    columns = r.body.get("columns", {})
    if not columns:
        return r.missing, target
    parts = []
    for tp, c in columns.items():
        stall = {name: num(c[name]["stall_s"]) for name in ("background", "in-step", "vllm")}
        ttft = {name: num(c[name]["late_ttft_s"]) for name in ("background", "in-step", "vllm")}
        parts.append(f"TP {tp}: longest gap **{stall['background']} s** in the background, {stall['in-step']} s in "
                     f"vLLM's step, {stall['vllm']} s without the connector; the restored request's TTFT "
                     f"{ttft['background']} / {ttft['in-step']} / {ttft['vllm']} s")
    headline = (f"{r.body['decoders']} requests decoding when a {r.body['prefix_tokens']}-token cached prefix "
                f"arrives (Tio/Tcomp = 1){drafting(r.body)}{chunking(r.body)}: " + "; ".join(parts))
    return headline, target


def vllm_eagle_row(r: Row) -> tuple[str, str]:
    target = ("a restore with the draft stays faster than vLLM's prefill with it; the draft's stored KV loaded, "
              "not rerun")
    s = r.summary
    if "loaded_vs_rerun_restore" not in s:
        return r.missing, target
    lengths = list(s["restore_vs_prefill_with_draft"])
    ratios = ", ".join(f"{n}: **{num(s['restore_vs_prefill_with_draft'][n])}×** "
                       f"({num(s['restore_vs_prefill_with_draft_rerun'][n])}× rerunning the draft, "
                       f"{num(s['restore_vs_prefill_without_draft'][n])}× without it)" for n in lengths)
    loaded = ", ".join(f"{num(s['loaded_vs_rerun_restore'][n])}×" for n in lengths)
    draft = {"draft_model": "a draft model"}.get(r.body.get("draft", "eagle"), "an EAGLE draft")
    headline = (f"TTFT of a restored prefix over vLLM's own prefill, both with {draft}, per prefix length, the "
                f"draft's KV loaded with the chunks: {ratios}; a restore loading the draft's KV over one rerunning "
                f"it: {loaded}; next tokens as vLLM's: {'yes' if s.get('next_token_matches') else 'no'}")
    return headline, target


ROWS: tuple[tuple[str, str, Callable[[Row], tuple[str, str]]], ...] = (
    ("restore_single", "single-request restore", restore_row),
    ("storage", "storage data plane", storage_row),
    ("latency", "fixed costs", latency_row),
    ("stages", "parallel stages", stages_row),
    ("batch", "batch replay of the Mooncake trace on the local cluster", batch_row),
    ("sched_scale", "the batch scheduler at production batch sizes", sched_scale_row),
    ("chaos", "kills and abuse", chaos_row),
    ("vllm", "vLLM with the connector", vllm_row),
    ("vllm_memory", "vLLM memory with the connector", vllm_memory_row),
    ("vllm_stall", "a restore beside decoding requests, vLLM", vllm_stall_row),
    ("vllm_stall_eagle", "a restore beside decoding requests with an EAGLE draft, vLLM", vllm_stall_row),
    ("vllm_stall_step256", "a restore beside decoding requests, prefill chunked, vLLM", vllm_stall_row),
    ("vllm_stall_eagle_step256", "a restore beside decoding requests with an EAGLE draft, prefill chunked, vLLM",
     vllm_stall_row),
    ("vllm_eagle", "an EAGLE draft in a restore, vLLM", vllm_eagle_row),
    ("vllm_draft_model", "a draft model in a restore, vLLM", vllm_eagle_row),
)


def footer(results: Results) -> str:
    problems = commit_problems(results)
    if not problems:
        commit = next((commit_of(b) for b in results.values()), None)
        return f"Results of commit {commit} (`cacheflow bench report --run`)."
    return (f"**Results of several commits, or of uncommitted code** ({'; '.join(problems)}): not one run of "
            "`cacheflow bench report --run`; each row's numbers belong to its own commit.")


def block(results: Results) -> str:
    """The generated table and its provenance line, between the markers."""
    lines = [BEGIN, "| benchmark (command) | headline (measured) | target |", "|---|---|---|"]
    for name, label, row in ROWS:
        if name in results:
            headline, target = row(Row(name, results[name]))
            lines.append(f"| {label} (`{COMMANDS[name]}`) | {headline} | {target} |")
    return "\n".join([*lines, "", footer(results), END])


def current_block(text: str, begin: str = BEGIN, end: str = END) -> str:
    """The README's region from `begin` to `end`, markers included."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"cacheflow bench: error: the README has no {begin} ... {end} region")
    return text[start:stop + len(end)]


def replace_block(path: Path, new: str, begin: str = BEGIN, end: str = END) -> bool:
    """Replace the README's region between the markers with `new` (markers included); whether it changed."""
    text = path.read_text()
    old = current_block(text, begin, end)
    if old == new:
        return False
    path.write_text(text.replace(old, new, 1))
    return True


def update_readme(path: Path, results: Results) -> bool:
    """Replace the README's table with the one these results give; whether it changed."""
    return replace_block(path, block(results))
