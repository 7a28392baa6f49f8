"""The rehearsal's verdict: checks over every rank's result, one table per module role,
`rehearsal passed` or every mismatch, and `rehearsal.json`."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from hcp.config.errors import ConfigError
from hcp.dcp.packing import rank_tokens
from hcp.model.cp_attention import scored_pairs
from hcp.model.cp_kernels import fused_kernel
from hcp.preflight.rehearse.checks import (Mismatch, check_collectives, check_creations,
                                       check_rendezvous)
from hcp.preflight.rehearse.device import reads_after_warmup, summary

GIB = 2 ** 30
JOB_RECORD = frozenset({"placement", "layouts", "ranks"})
"""Keys of a report's `job` that record what it rehearsed (`write_json`) without being checked:
`layout=auto` applies one rehearsal's correction to every layout it searches."""


def find_mismatches(results: dict, world: int, device_gib: float) -> list[Mismatch]:
    """Every fault in the rank results (`hcp.preflight.rehearse.runner.RankResult`): a rank that
    raised, group creations, collectives, sends/receives and deadlock, a peak over the device,
    a device read inside a micro-batch after the first step (fake CUDA:
    `device.reads_after_warmup`)."""
    out = [Mismatch("rank failed", [r], None, None, {r: res.error.strip().splitlines()[-1]},
                    "the rank raised (traceback in rehearsal.json)")
           for r, res in sorted(results.items()) if res.error]
    out += check_creations({r: res.creations for r, res in results.items()})
    traces = {r: res.ops for r, res in results.items()}
    out += check_collectives(traces)
    out += check_rendezvous(traces, world)
    out += [Mismatch("memory", [r], None, None,
                     {r: f"peak {res.peak_bytes / GIB:.2f} GiB tracked > "
                         f"cluster.device_memory_gib={device_gib}"},
                     "the rank does not fit the device")
            for r, res in sorted(results.items()) if res.peak_bytes / GIB > device_gib]
    for r, res in sorted(results.items()):
        reads = reads_after_warmup(res.device_events)
        if reads:
            sites = "; ".join(f"{w} x{n}" for w, n in reads.most_common())
            out.append(Mismatch("device read", [r], None, None, {r: sites},
                                "device-to-host reads inside micro-batches after the first step: "
                                "each stalls the host until the GPU catches up"))
    return out


def micro_batch_flops(results: dict, stages: dict[int, int | None], cost,
                      layout) -> dict[int, list[tuple]]:
    """rank -> [(FLOPs counted, FLOPs by the cost model)] of each LLM micro-batch of its last
    step; `stages`: rank -> its LLM PP stage (None: no LLM stage); `cost`: the LLM's
    `hcp.dcp.cost_model.CostModel` (`CostModel.micro_batch_flops` of the rank's CP shard and of
    the pairs its CP attention calls score on the CPU kernels the ranks run, of the rows its LM
    head scores); `layout`: the LLM's resolved layout (its cp_comm and recompute)."""
    masked = fused_kernel("cpu").masks

    def modelled(stage, lengths, c, cp_rank, loss_tokens):
        pairs = scored_pairs(lengths, c, cp_rank, layout.cp_comm, masked)
        local = float(rank_tokens(lengths, c).sum())
        # under CP the loss scores as many of the shard's rows as the micro-batch has loss
        # tokens (llava.loss: the shard's own count is not known on the host)
        head_rows = loss_tokens if c == 1 or loss_tokens is None else min(local, loss_tokens)
        return float(cost.micro_batch_flops(local, pairs, layout.recompute, head_rows)[stage])

    return {r: [(counted, modelled(stages[r], *sizes)) for counted, *sizes in res.micro_batches
                if sum(sizes[0])]
            for r, res in results.items() if stages.get(r) is not None}


def role_rows(results: dict, roles: dict[int, str], plan_gib: dict[int, float],
              micro: dict) -> list[dict]:
    """One row per role (ranks with the same modules and PP stages): ranks rehearsed, the
    largest per-rank collectives issued, p2p bytes sent, peak GiB tracked (and its largest
    `MemTracker` categories), plan mode's estimate, FLOPs counted in the last step, and the
    LLM micro-batches' FLOPs counted and modelled (`micro`: `micro_batch_flops`) with the
    largest relative difference of one micro-batch."""
    rows: dict[str, dict] = {}
    for r, res in sorted(results.items()):
        row = rows.setdefault(roles[r], {"role": roles[r], "ranks": [], "collectives": 0,
                                         "sent_mib": 0.0, "peak_gib": 0.0, "plan_gib": 0.0,
                                         "flops": 0, "llm_counted": 0.0, "llm_modelled": 0.0,
                                         "flops_diff": 0.0, "categories": {}})
        row["ranks"].append(r)
        row["collectives"] = max(row["collectives"], sum(op.kind == "collective" for op in res.ops))
        row["sent_mib"] = max(row["sent_mib"],
                              sum(op.nbytes for op in res.ops if op.kind == "send") / 2 ** 20)
        if res.peak_bytes / GIB >= row["peak_gib"]:
            row["categories"] = {k: v / GIB for k, v in res.peak_categories.items() if v}
        row["peak_gib"] = max(row["peak_gib"], res.peak_bytes / GIB)
        row["plan_gib"] = max(row["plan_gib"], plan_gib.get(r, 0.0))
        row["flops"] = max(row["flops"], res.flops)
        pairs = micro.get(r, [])
        if pairs and sum(c for c, _ in pairs) >= row["llm_counted"]:
            row["llm_counted"], row["llm_modelled"] = (sum(c for c, _ in pairs),
                                                       sum(m for _, m in pairs))
        row["flops_diff"] = max([row["flops_diff"]] + [abs(c / m - 1) for c, m in pairs if m])
    return list(rows.values())


def _ranks_text(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) \
        and len(ranks) > 1 else ",".join(map(str, ranks))


def format_report(rows: list[dict], mismatches: list[Mismatch], wall_s: float, classes=None) -> str:
    """The console report: the role table (memory tracked against plan mode's estimate, the
    LLM micro-batches' FLOPs counted against the cost model's), how many ranks were rehearsed
    and how many derived from them (`classes`: `hcp.preflight.rehearse.classes.RankClass`es of
    a class rehearsal), then `rehearsal passed` or every mismatch."""
    head = (f"{'role':<28} {'ranks':>9} {'collectives':>11} {'p2p sent MiB':>12} {'peak GiB':>9} "
            f"{'plan GiB':>9} {'GFLOP/step':>11} {'LLM GFLOP':>10} {'modelled':>10} "
            f"{'worst mb':>8}")
    lines = ["hcp rehearsal: per rank (largest in each role)", head]
    for row in rows:
        llm = (f"{row['llm_counted'] / 1e9:>10.1f} {row['llm_modelled'] / 1e9:>10.1f} "
               f"{100 * row['flops_diff']:>7.1f}%" if row["llm_modelled"]
               else f"{'-':>10} {'-':>10} {'-':>8}")
        lines.append(f"{row['role']:<28} {_ranks_text(row['ranks']):>9} {row['collectives']:>11} "
                     f"{row['sent_mib']:>12.2f} {row['peak_gib']:>9.3f} {row['plan_gib']:>9.3f} "
                     f"{row['flops'] / 1e9:>11.1f} {llm}")
    lines.append("peak GiB: MemTracker on the real ops (parameters, gradients, optimizer states, "
                 "activations, temporaries); plan GiB: plan mode's estimate. LLM GFLOP: the last "
                 "step's LLM micro-batches counted (recompute and the flash backward's recomputed "
                 "scores included) and by the cost model; worst mb: the largest difference of one "
                 f"micro-batch. Wall {wall_s:.1f} s")
    if classes is not None:
        derived = sum(len(c.members) - 1 for c in classes)
        lines.append(f"by class: {len(classes)} classes; {len(classes)} ranks rehearsed, {derived} "
                     f"derived (every check above ran on all of them)")
    if not mismatches:
        lines.append("rehearsal passed")
    else:
        lines.append(f"rehearsal failed: {len(mismatches)} mismatches")
        lines += [str(m) for m in mismatches]
    return "\n".join(lines)


def write_json(path: str, rows, mismatches, micro: dict, results, wall_s: float,
               plan_gib: dict[int, float], job: dict, classes=None) -> None:
    """`rehearsal.json`: the job (`job`: its `job_facts`, and the `JOB_RECORD`: placement,
    layouts, ranks rehearsed), the table, every mismatch, and each rank's op count, peak (and
    each step's, with its LLM micro-batches' worth of tokens), plan mode's estimate
    (`plan_gib`: rank -> GiB), peak categories, FLOPs (per LLM micro-batch: counted,
    modelled) and error (traceback), the representative a derived rank's trace comes from, and
    the classes (representative -> members) of a class rehearsal."""
    data = {"passed": not mismatches, "wall_s": wall_s, "job": job, "roles": rows,
            "classes": None if classes is None else {str(c.rep): list(c.members) for c in classes},
            "mismatches": [m.__dict__ | {"sides": {str(k): v for k, v in m.sides.items()}}
                           for m in mismatches],
            "ranks": {str(r): {"ops": len(res.ops), "groups_created": len(res.creations),
                               "peak_gib": res.peak_bytes / GIB,
                               "step_peaks_gib": [b / GIB for b in res.step_peaks],
                               "step_worth": res.step_worth, "plan_gib": plan_gib.get(r),
                               "peak_categories_gib":
                               {k: v / GIB for k, v in res.peak_categories.items()},
                               "flops": res.flops, "micro_batch_flops": micro.get(r, []),
                               "derived_from": res.derived_from,
                               "device_events": [[k, d, a, b, c, dict(w)] for k, d, a, b, c, w
                                                 in summary(res.device_events)],
                               "error": res.error}
                      for r, res in sorted(results.items())}}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def job_facts(cfg, specs, world: int) -> dict:
    """What a `rehearsal.json` must share with the run that reads it (`memory_correction`), by
    config key: `world_size`, `precision`, `trainer.micro_batch_tokens`, and each module's
    architecture fields and `freeze` (`specs`: `hcp.config.specs.ModuleSpecs`; the layout and
    the attention backend left out: `layout=auto` searches the one, the other is no shape)."""
    facts = {"world_size": int(world), "precision": str(cfg.precision),
             "trainer.micro_batch_tokens": int(cfg.trainer.micro_batch_tokens)}
    for spec in specs.modules:
        arch = {k: v
                for k, v in asdict(spec.arch).items() if k not in ("layout", "attention_backend")}
        facts |= {f"{spec.key}.{k}": v for k, v in {**arch, "freeze": bool(spec.freeze)}.items()}
    return facts


def memory_correction(path: str, facts: dict) -> float:
    """The factor (>= 1) by which `layout=auto` scales plan mode's memory estimates, from a
    `rehearsal.json` (`rehearse.report`) of this run (`facts`: its `job_facts`, which the
    report's `job` must hold, value for value): the largest tracked / plan peak ratio over its
    roles, 1 when plan mode already covers every tracked peak.

    Raises:
        ConfigError: naming `rehearse.report` when the path is not a file, the file is not
            JSON, it records no job or another job (the first differing key, both values), a
            rank of it raised, or it holds no role with both figures.
    """
    fix = "give the rehearsal.json that mode=rehearse wrote into its run directory"
    if not os.path.isfile(path):
        raise ConfigError("rehearse.report", path,
                          "not a file" if os.path.exists(path) else "no such file", fix)
    try:
        with open(path) as f:
            report = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError("rehearse.report", path, f"not JSON ({err})", fix) from None
    report = report if isinstance(report, dict) else {}
    again = ("rehearse this run (its command with mode=rehearse, layout=auto picks the layout) and "
             "give the rehearsal.json it writes, or drop rehearse.report")
    job = report.get("job")
    if not isinstance(job, dict):
        raise ConfigError("rehearse.report", path, "it records no job to check against this run (a "
                          "rehearsal.json of an older hcp, or not a rehearsal)", again)

    def said(values: dict, key: str) -> str:
        return f"{key}={values[key]!r}" if key in values else f"no {key}"

    for key in sorted(facts.keys() | job.keys() - JOB_RECORD,
                      key=lambda k: (k not in facts, "." in k, k)):
        if key not in job or key not in facts or job[key] != facts[key]:
            raise ConfigError("rehearse.report", path,
                              f"another job's rehearsal: it rehearsed {said(job, key)}, "
                              f"this run has {said(facts, key)}", again)
    raised = sorted(int(r) for r, res in report.get("ranks", {}).items()
                    if isinstance(res, dict) and res.get("error"))
    if raised:
        raise ConfigError("rehearse.report", path,
                          f"rank {raised[0]} raised in that rehearsal, so its peak is "
                          "not a whole step's",
                          "fix what it raised (its traceback is in the file) and rehearse again")
    roles = report.get("roles", [])
    ratios = [r["peak_gib"] / r["plan_gib"] for r in roles
              if isinstance(r, dict) and r.get("peak_gib") and r.get("plan_gib")]
    if not ratios:
        raise ConfigError("rehearse.report", path,
                          "no role with a tracked peak and a plan estimate",
                          "give a rehearsal.json of a finished mode=rehearse run")
    return max(1.0, max(ratios))
