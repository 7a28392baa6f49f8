"""The rehearsal's verdict: checks over every rank's result, one table per module role,
`rehearsal passed` or every mismatch, and `rehearsal.json`."""
from __future__ import annotations

import json

from hcp.model.flops import model_flops
from hcp.train.rehearse.checks import (Mismatch, check_collectives, check_creations,
                                       check_rendezvous)

GIB = 2 ** 30


def find_mismatches(results: dict, world: int, device_gib: float) -> list[Mismatch]:
    """Every fault in the rank results (`hcp.train.rehearse.runner.RankResult`): a rank that
    raised, group creations, collectives, sends/receives and deadlock, a peak over the device."""
    out = [Mismatch("rank failed", [r], None, None, {r: res.error.strip().splitlines()[-1]},
                    "the rank raised (traceback in rehearsal.json)")
           for r, res in sorted(results.items()) if res.error]
    out += check_creations({r: res.creations for r, res in results.items()})
    traces = {r: res.ops for r, res in results.items()}
    out += check_collectives(traces)
    out += check_rendezvous(traces, world)
    out += [Mismatch("memory", [r], None, None,
                     {r: f"peak {res.peak_bytes / GIB:.2f} GiB tracked > cluster.device_memory_gib={device_gib}"},
                     "the rank does not fit the device")
            for r, res in sorted(results.items()) if res.peak_bytes / GIB > device_gib]
    return out


def role_rows(results: dict, roles: dict[int, str], plan_gib: dict[int, float]) -> list[dict]:
    """One row per role (ranks with the same modules and PP stages): ranks rehearsed, the
    largest per-rank collectives issued, p2p bytes sent, peak GiB tracked, plan mode's
    estimate and FLOPs counted in one step."""
    rows: dict[str, dict] = {}
    for r, res in sorted(results.items()):
        row = rows.setdefault(roles[r], {"role": roles[r], "ranks": [], "collectives": 0, "sent_mib": 0.0,
                                         "peak_gib": 0.0, "plan_gib": 0.0, "flops": 0})
        row["ranks"].append(r)
        row["collectives"] = max(row["collectives"], sum(op.kind == "collective" for op in res.ops))
        row["sent_mib"] = max(row["sent_mib"], sum(op.nbytes for op in res.ops if op.kind == "send") / 2 ** 20)
        row["peak_gib"] = max(row["peak_gib"], res.peak_bytes / GIB)
        row["plan_gib"] = max(row["plan_gib"], plan_gib.get(r, 0.0))
        row["flops"] = max(row["flops"], res.flops)
    return list(rows.values())


def _ranks_text(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
        else ",".join(map(str, ranks))


def format_report(rows: list[dict], mismatches: list[Mismatch], flops: dict, wall_s: float) -> str:
    """The console report: the role table, the step's FLOPs counted against the cost model's,
    then `rehearsal passed` or every mismatch."""
    head = (f"{'role':<28} {'ranks':>9} {'collectives':>11} {'p2p sent MiB':>12} "
            f"{'peak GiB':>9} {'plan GiB':>9} {'GFLOP/step':>11}")
    lines = ["hcp rehearsal: per rank (largest in each role)", head]
    for row in rows:
        lines.append(f"{row['role']:<28} {_ranks_text(row['ranks']):>9} {row['collectives']:>11} "
                     f"{row['sent_mib']:>12.2f} {row['peak_gib']:>9.3f} {row['plan_gib']:>9.3f} "
                     f"{row['flops'] / 1e9:>11.2f}")
    lines.append(f"last step, all ranks rehearsed: {flops['counted'] / 1e9:.2f} GFLOP counted "
                 f"(every module, recompute included), {flops['modelled'] / 1e9:.2f} GFLOP by the cost "
                 f"model (LLM, 3 x forward) for the same micro-batches; wall {wall_s:.1f} s")
    if not mismatches:
        lines.append("rehearsal passed")
    else:
        lines.append(f"rehearsal failed: {len(mismatches)} mismatches")
        lines += [str(m) for m in mismatches]
    return "\n".join(lines)


def step_flops(cfg, results: dict, world: int) -> dict:
    """The last step's FLOPs counted on all rehearsed ranks, and the cost model's
    (`hcp.model.flops.model_flops`) of that step's global tokens; the modelled figure is
    scaled to the share of ranks rehearsed."""
    counted = sum(res.flops for res in results.values())
    steps = [res.step_counts[-1] for res in results.values() if res.step_counts]
    modelled = model_flops(cfg.llm, *steps[0]) * len(results) / world if steps else 0.0
    return {"counted": counted, "modelled": modelled}


def write_json(path: str, rows, mismatches, flops, results, wall_s: float) -> None:
    """`rehearsal.json`: the table, the FLOPs, every mismatch, and each rank's op count and
    error (traceback)."""
    data = {"passed": not mismatches, "wall_s": wall_s, "roles": rows, "flops": flops,
            "mismatches": [m.__dict__ | {"sides": {str(k): v for k, v in m.sides.items()}}
                           for m in mismatches],
            "ranks": {str(r): {"ops": len(res.ops), "groups_created": len(res.creations),
                               "peak_gib": res.peak_bytes / GIB, "flops": res.flops, "error": res.error}
                      for r, res in sorted(results.items())}}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
