"""The training-run checks of issue 39 in scripts/gpu_check.sh: one short run each, printed as
one line (`name: ...`); a run that raises prints its last line and counts as a failure.

- `fsdp`: one rank's LLM with `dp_shard=true` and several micro-batches per step: the step's
  peak memory against plan mode's estimate of the rank (on one GPU FSDP's shard is the whole
  tensor: it checks the plan's accounting of a dp_shard step, not the sharding factor);
- `checkpoint`: the same trainer's checkpoint save: its peak against the training step's;
- `calibrate`: `mode=calibrate` at the run's precision (`precision=bf16`), in a subprocess;
- `device`: the device a rank picks when its task sees one GPU under a LOCAL_RANK of 1
  (`srun --gpus-per-task=1`), in a subprocess;
- `rehearsal`: the device events of two real steps (`hcp.preflight.rehearse.device`) next to
  the fake-CUDA rehearsal's of the same rank (`mode=rehearse rehearse.device=cuda`).
On the CPU (`--device cpu --tiny`) the same code runs on tiny models (peaks are the process's
RSS there: printed, not compared).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections import Counter

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["+recipe=llama_tiny", "trainer.global_batch_size=4", "trainer.micro_batch_tokens=512"]
FULL = ["+recipe=llama_tiny", "llm.hidden_size=2048", "llm.num_layers=8", "llm.num_heads=16",
        "llm.num_kv_heads=4", "llm.ffn_hidden_size=5632", "trainer.micro_batch_tokens=4096",
        "trainer.global_batch_size=64"]
GIB = 2 ** 30


def _overrides(device, tiny: bool, run_dir: str) -> list[str]:
    return [*(TINY if tiny else FULL), "precision=bf16", "logger=none", "launcher.nproc_per_node=1",
            "trainer.progress_bar=false", "trainer.eval_every=0", f"checkpoint.dir={run_dir}/ckpt",
            f"launcher.backend={'nccl' if device.type == 'cuda' else 'gloo'}"]


def _peak(device) -> float:
    """GiB: the CUDA allocator's peak since the last reset, or the process's RSS on the CPU."""
    from hcp.train.throughput import peak_memory_bytes

    return peak_memory_bytes(device) / GIB


def _reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _trainer(overrides: list[str], run_dir: str):
    """A one-rank `Trainer` of `overrides` in this process (its process group started here)."""
    from hcp.config.compose import compose_config
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.config.specs import resolve_modules
    from hcp.train.trainer import Trainer

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    cfg = compose_config(overrides, run_dir=run_dir, resolve=True)
    list(prepare_data(cfg, resolve_modules(cfg, validate(cfg, 1))))
    return cfg, Trainer(cfg, run_dir)


def fsdp_and_checkpoint(device, tiny: bool, run_dir: str) -> tuple[str, str]:
    """The `fsdp` and `checkpoint` lines (module docstring)."""
    from hcp.config.layouts import resolve_layouts
    from hcp.preflight.plan_mode import memory_per_rank

    cfg, tr = _trainer(_overrides(device, tiny, run_dir) + ["llm.layout.dp_shard=true"], run_dir)
    tr.train_step()                                      # warm-up: the optimizer's state exists
    _reset(device)
    metrics = tr.train_step()
    train_peak = _peak(device)
    _reset(device)
    tr.save()
    save_peak = _peak(device)
    tr.ahead.close()
    micro = metrics["micro_batches"]
    plan = memory_per_rank(cfg, resolve_layouts(cfg, 1), 1, micro_batches=micro)[0]["total"]
    torch.distributed.destroy_process_group()
    unit = "GiB" if device.type == "cuda" else "GiB RSS"
    return (f"fsdp: dp_shard step of {micro} micro-batches: peak {train_peak:.2f} {unit}, "
            f"plan {plan:.2f} GiB ({train_peak / plan - 1:+.0%})",
            f"checkpoint: save peak {save_peak:.2f} {unit}, training peak {train_peak:.2f} {unit} "
            f"({save_peak / train_peak - 1:+.0%}; target within 10%)")


def _cli(args: list[str], env=None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(env or os.environ, PYTHONPATH=REPO))


def calibrate(device, tiny: bool, run_dir: str) -> str:
    """The `calibrate` line: `mode=calibrate` at bf16 (module docstring)."""
    proc = _cli(["train.py", *_overrides(device, tiny, run_dir), "mode=calibrate",
                 f"hydra.run.dir={run_dir}/cal"], timeout=400)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return f"calibrate: precision=bf16 exit {proc.returncode}: {last[0][:160]}"


def device_choice() -> str:
    """The `device` line: the device of a rank whose task sees one GPU under LOCAL_RANK=1."""
    code = ("from omegaconf import OmegaConf; from hcp.launch.distributed import init_distributed; "
            "print(init_distributed(OmegaConf.create({'backend': 'auto', 'timeout_s': 60})))")
    one = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29518", CUDA_VISIBLE_DEVICES=one)
    proc = _cli(["-c", code], env=env, timeout=120)
    out = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return f"device: one visible GPU, LOCAL_RANK=1 -> exit {proc.returncode}: {out[0][:160]}"


def _events_table(counts: Counter) -> dict[str, int]:
    from hcp.preflight.rehearse.device import summary

    return {f"{k}: {d}": a + b + c for k, d, a, b, c, _ in summary(counts)}


def rehearsal_vs_real(device, tiny: bool, run_dir: str) -> list[str]:
    """The `rehearsal` lines: device events of two real steps of rank 0 against the fake-CUDA
    rehearsal's two steps of the same job (module docstring)."""
    from hcp.preflight.rehearse.device import DeviceEvents

    overrides = _overrides(device, tiny, run_dir)
    _, tr = _trainer(overrides, run_dir)
    events = DeviceEvents()
    with events.recording():
        for step in (1, 2):
            events.step = step
            tr.train_step()
    tr.ahead.close()
    torch.distributed.destroy_process_group()
    real = _events_table(events.counts)
    proc = _cli(["train.py", *overrides, "mode=rehearse", "rehearse.device=cuda",
                 "rehearse.steps=2",
                 f"hydra.run.dir={run_dir}/rehearse"], timeout=400)
    report = os.path.join(run_dir, "rehearse", "rehearsal.json")
    if not os.path.exists(report):
        said = (proc.stdout + proc.stderr).strip()[-300:]
        return [f"rehearsal: FAIL (exit {proc.returncode}): {said}"]
    (rank,) = json.load(open(report))["ranks"].values()
    fake = {f"{k}: {d}": a + b + c for k, d, a, b, c, _ in rank["device_events"]}
    lines = [f"rehearsal: device events of 2 steps, {'real ' + device.type:>9} vs fake cuda"]
    lines += [f"  {what:<60} {real.get(what, 0):>6} {fake.get(what, 0):>6}"
              for what in sorted(real.keys() | fake.keys())]
    return lines


def main(device, tiny: bool) -> bool:
    """Print every run's lines; False when one raised."""
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("fsdp/checkpoint",
                           lambda: fsdp_and_checkpoint(device, tiny, f"{tmp}/fsdp")),
                          ("calibrate", lambda: [calibrate(device, tiny, f"{tmp}/cal")]),
                          ("device", lambda: [device_choice()]),
                          ("rehearsal", lambda: rehearsal_vs_real(device, tiny, f"{tmp}/reh"))):
            try:
                print("\n".join(run()), flush=True)
            except Exception:  # noqa: BLE001 - one run's failure is a line, the others still run
                ok = False
                last = traceback.format_exc().strip().splitlines()[-1][:200]
                print(f"{name}: FAIL {last}", flush=True)
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
    return ok
