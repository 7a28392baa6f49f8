"""Runs under fake CUDA (tests/test_rehearse_cuda.py starts it with the shim preloaded:
`hcp.preflight.rehearse.fake_cuda.preloaded_env`) and prints one JSON line.

    python tests/fake_cuda_probe.py planted       # seeded device events, counted by the checker
    python tests/fake_cuda_probe.py rehearse DIR A B -- DIR2 C  # mode=rehearse of A B, then C
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def planted() -> dict:
    """A tiny step on fake CUDA with one of each event the checker claims to see, planted in a
    micro-batch of step 2 (after warm-up): {kind: {detail: events}} and the failing check."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hcp.model.cp_attention import Segments
    from hcp.model.cp_kernels import fused_kernel
    from hcp.preflight.rehearse.device import DeviceEvents, reads_after_warmup, summary
    from hcp.preflight.rehearse.fake_cuda import patched
    from hcp.schedule.executor import Executor

    events, errors, dtypes = DeviceEvents(), [], []
    with FakeTensorMode(allow_non_fake_inputs=True), patched(events.read), events.recording():
        w = torch.randn(8, 8, device="cuda:0", requires_grad=True)

        def forward(i, x):
            h = torch.ones(4, 8).to("cuda:0", non_blocking=True)        # pageable, non_blocking
            h = h + torch.ones(4, 8).pin_memory().to("cuda:0", non_blocking=True)  # pinned
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = h @ w
            dtypes.append(str(y.dtype))
            q = torch.randn(16, 2, 8, device="cuda:0")                  # fp32: CP's math fallback
            one = Segments(None, torch.zeros(2, dtype=torch.int32, device="cuda:0"), [16], 16)
            fused_kernel("cuda").forward(q, q, q, True, one, one)       # one ragged block
            qb = q.bfloat16().transpose(0, 1)[None]                     # [1, H, L, D]
            F.scaled_dot_product_attention(qb, qb, qb, is_causal=True)
            try:
                (w.sum() > 0).item()                                          # a device read
            except Exception as err:  # noqa: BLE001 - a fake tensor has no value to read
                errors.append(type(err).__name__)
            try:
                w + torch.ones(8, 8)                                          # a CPU operand
            except Exception as err:  # noqa: BLE001 - FakeTensor refuses the mixed devices
                errors.append(type(err).__name__)
            return y.float().sum()

        for step in (1, 2):
            events.step = step
            ex = Executor(forward, {})
            ex.outputs[0] = ex.forward(0, None)
            ex._backward(0)
    return {"autocast_dtypes": dtypes, "grad": str(w.grad.device), "errors": errors,
            "events": {f"{k}|{d}": [a, b, c] for k, d, a, b, c, _ in summary(events.counts)},
            "flagged": sum(reads_after_warmup(events.counts).values())}


def rehearse(overrides: list[str]) -> dict:
    """`mode=rehearse rehearse.device=cuda` of `overrides` in this process: the mismatches, the
    printed report's lines and each rank's device events."""
    import contextlib
    import io

    from hcp.config.layouts import world_size_of
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse import run_rehearsal
    from tests.cfg_utils import compose_cfg, with_specs

    run_dir = overrides.pop(0)
    os.makedirs(run_dir, exist_ok=True)
    cfg = compose_cfg(["mode=rehearse", "logger=none", "rehearse.device=cuda", *overrides],
                      run_dir=run_dir)
    world = world_size_of(cfg, 4)
    validate(cfg, world)
    list(prepare_data(*with_specs(cfg)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        found = run_rehearsal(cfg, run_dir, world, progress=False)
    report = json.load(open(os.path.join(run_dir, "rehearsal.json")))
    return {"mismatches": [str(m) for m in found], "printed": out.getvalue(),
            "ranks": {r: {"error": v["error"], "device_events": v["device_events"]}
                      for r, v in report["ranks"].items()}}


if __name__ == "__main__":
    from hcp.preflight.rehearse import fake_cuda

    assert fake_cuda.active(), "start this with fake_cuda.preloaded_env()"
    if sys.argv[1] == "planted":
        print(json.dumps(planted()))
    else:
        groups = " ".join(sys.argv[2:]).split(" -- ")
        print(json.dumps([rehearse(g.split()) for g in groups]))
