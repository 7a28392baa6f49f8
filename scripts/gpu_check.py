"""The device checks of issue 10 part 4 (run by scripts/gpu_check.sh; see there).

    python scripts/gpu_check.py                       # CUDA: the checks below, ~1B LLaMA
    python scripts/gpu_check.py --device cpu --tiny   # dry run of the same code on CPU

1. CP attention on the device's fused kernels (`hcp.model.cp_kernels`: flash for bf16, the
   math kernel for fp32) against the CPU reference (per-document softmax in float64,
   `reference`): one long document packed with short ones; every CP rank's calls (`cp_calls`,
   both strategies, cp 1, 2, 4) computed on this one device, the all-gather and the ring
   emulated without a process group (`emulated_cp`).
   Outputs and q/k/v gradients: fp32 (TF32 off) within rtol 1e-4 / atol 1e-5, bf16 within
   2e-2 of the largest reference value. Also the non-CP THD path (`thd_attention`, the backend
   `auto` picks). With Transformer Engine and 2 GPUs: `attention_backend=te` under CP (TE's THD CP,
   2 NCCL ranks, both strategies) against the same reference (`check_te_cp`); skipped otherwise.
2. One training step (forward, backward, AdamW) of a ~1B LLaMA (hidden 2048, 22 layers, 32 query
   and 4 kv heads, SwiGLU 5632, vocab 32000: TinyLlama-1.1B's shape) on one THD micro-batch of
   `--tokens` (default 32768) tokens in documents of mixed lengths, bf16 autocast with fp32
   parameters (hcp's `precision=bf16`); the step time after one warm-up step, MFU = model FLOPs
   of the real tokens (`hcp.train.throughput.model_flops`) / step time / `--peak-tflops` (989,
   H100/H200 dense bf16), and the peak GPU memory of the step.
3. The training runs of issue 39 (scripts/gpu_check_runs.py): FSDP dp_shard memory against plan
   mode, a checkpoint save's peak against the training peak, calibration at bf16, the device a
   task with one visible GPU picks, and the fake-CUDA rehearsal's device events against a real
   run's.
Exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hcp.config.precision import Precision  # noqa: E402
from hcp.config.schema import LLMConfig  # noqa: E402
from hcp.data.packing import Batch  # noqa: E402
from hcp.model import LlavaModel  # noqa: E402
from hcp.model.attention import thd_attention  # noqa: E402
from hcp.model.backends import attention_fn, resolve_backend  # noqa: E402
from hcp.model.cp_attention import (CPAttentionPlan, Partial, Rows,  # noqa: E402
                                    _FusedAttention, cp_calls)
from hcp.model.cp_kernels import fused_kernel  # noqa: E402
from hcp.parallel.cp_sharding import cp_shard  # noqa: E402
from hcp.train.throughput import model_flops  # noqa: E402


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def reference(q, k, v, cu):
    """Per-document causal softmax attention in float64 on CPU. q [T, Hq, D], k, v [T, Hkv, D]."""
    outs, rep = [], q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = q[s:e], k[s:e].repeat_interleave(rep, 1), v[s:e].repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(q.shape[-1])
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        outs.append(torch.einsum("hqk,khd->qhd",
                                 scores.masked_fill(~causal, float("-inf")).softmax(-1), vd))
    return torch.cat(outs)


def _shifted(calls, offset: int):
    """Calls whose key rows index source j's shard inside the concatenation of all shards."""
    def shift(rows):
        if rows.index is None:
            return Rows(rows.start + offset, rows.n, rows.length)
        return Rows(0, rows.n, rows.length, rows.index + offset)
    return [dataclasses.replace(c, k=shift(c.k)) for c in calls]


def emulated_cp(q_all, k_all, v_all, w, cu, c, comm, device, dtype):
    """Every rank's CP attention on one device; returns (output, [q, k, v grads]) scattered back
    to the unsharded token order (fp32, CPU), for the loss sum(out * w). allgather: each rank's
    calls over the concatenated shards (what the all-gather delivers); p2p: each source's calls
    offset into the concatenation (one softmax over all sources, differentiable), and the ring's
    own fold, source by source in ring order, must give the same values."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    shards = [cp_shard(cu, c, r) for r in range(c)]
    leaves = [[x[s.token_index].to(device, dtype).requires_grad_() for x in (q_all, k_all, v_all)]
              for s in shards]
    kernel, t_loc = fused_kernel(device), len(shards[0].valid)
    out_all = torch.zeros(q_all.shape)
    for r, s in enumerate(shards):
        q = leaves[r][0]
        kv = torch.stack([torch.cat([leaves[j][i] for j in range(c)]) for i in (1, 2)], dim=1)
        per_source = cp_calls(lengths, c, r, comm, device, masked=kernel.masks)
        calls = [call for j, cs in enumerate(per_source) for call in _shifted(cs, j * t_loc)]
        calls.sort(key=lambda call: not call.first)  # a row's first call before the others
        out = _FusedAttention.apply(q, kv, CPAttentionPlan(None, comm, [calls], kernel))
        if comm == "p2p":
            with torch.no_grad():
                ring = Partial.empty(q)
                for j in ((r - step) % c for step in range(c)):
                    kv_j = torch.stack([leaves[j][1], leaves[j][2]], dim=1)
                    ring.fold(q, kv_j, per_source[j], kernel)
            bf16 = dtype == torch.bfloat16
            torch.testing.assert_close(out, ring.result(dtype), rtol=2e-2 if bf16 else 1e-5,
                                       atol=2e-2 if bf16 else 1e-5)
        keep = s.valid.to(device)[:, None, None]
        (out.float() * keep * w[s.token_index].to(device, torch.float32)).sum().backward()
        out_all[s.token_index[s.valid]] = out.detach().float().cpu()[s.valid]
    grads = []
    for i, full in enumerate((q_all, k_all, v_all)):
        g = torch.zeros(full.shape)
        for r, s in enumerate(shards):
            g.index_add_(0, s.token_index[s.valid], leaves[r][i].grad.float().cpu()[s.valid])
        grads.append(g)
    return out_all, grads


def close(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """fp32: allclose(rtol 1e-4, atol 1e-5); bf16: max |x - ref| <= 2e-2 * max |ref| (bf16
    inputs alone are rounded by 2^-9 relative, and gradients sum many such terms)."""
    ref = ref.float()
    if dtype == torch.bfloat16:
        return bool((x - ref).abs().max() <= 2e-2 * ref.abs().max())
    return torch.allclose(x, ref, rtol=1e-4, atol=1e-5)


def check_attention(device, lengths) -> bool:
    g = torch.Generator().manual_seed(0)
    cu = cu_of(lengths)
    t = int(cu[-1])
    q, k, v = (torch.randn(t, h, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, cu)
    w = torch.randn(q.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), (qr, kr, vr))
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for c, comm in ((1, "allgather"), (2, "allgather"), (2, "p2p"), (4, "allgather"),
                        (4, "p2p")):
            start = time.perf_counter()
            out, grads = emulated_cp(q, k, v, w, cu, c, comm, device, dtype)
            errs = [(out - ref.detach().float()).abs().max().item()] + \
                   [(a - b.float()).abs().max().item() for a, b in zip(grads, ref_grads)]
            good = close(out, ref.detach(), dtype) and all(
                close(a, b, dtype) for a, b in zip(grads, ref_grads))
            ok &= good
            print(f"cp attention    {device} {str(dtype)[6:]:>8} cp{c} {comm:<9} max |err| out "
                  f"{errs[0]:.2e} dq {errs[1]:.2e} dk {errs[2]:.2e} dv {errs[3]:.2e} "
                  f"{'OK' if good else 'FAIL'} ({time.perf_counter() - start:.1f} s)")
        backend = resolve_backend("auto", device, dtype)
        fn = attention_fn(backend) if backend != "torch" else thd_attention
        x = [t_.to(device, dtype).requires_grad_() for t_ in (q, k, v)]
        out = fn(*x, cu.to(device), max(lengths))
        (out.float() * w.to(device, torch.float32)).sum().backward()
        errs = [(out.float().cpu() - ref.detach().float()).abs().max().item()]
        good = close(out.float().cpu(), ref.detach(), dtype) and all(
            close(a.grad.float().cpu(), b, dtype) for a, b in zip(x, ref_grads))
        ok &= good
        print(f"thd attention   {device} {str(dtype)[6:]:>8} backend {backend}: max |err| out "
              f"{errs[0]:.2e} {'OK' if good else 'FAIL'}")
    return ok


def _te_cp_rank(rank: int, world: int, port: int, comm: str, lengths, results) -> None:
    """One rank of `check_te_cp`: its shard through TE's THD CP vs the float64 reference."""
    import torch.distributed as dist

    from hcp.model.te_cp import te_cp_attention

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    g = torch.Generator().manual_seed(0)
    cu = cu_of(lengths)
    q, k, v = (torch.randn(int(cu[-1]), h, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2))
    ref = reference(q, k, v, cu)
    shard = cp_shard(cu, world, rank)
    local = [x[shard.token_index].to(f"cuda:{rank}", torch.bfloat16).requires_grad_()
             for x in (q, k, v)]
    out = te_cp_attention(comm)(cu, dist.group.WORLD, torch.device(f"cuda:{rank}"))(*local)
    out.float().sum().backward()   # the backward runs and gives finite gradients
    keep = shard.valid
    good = close(out.float().cpu()[keep], ref[shard.token_index][keep], torch.bfloat16) and all(
        torch.isfinite(x.grad).all().item() for x in local)
    results[rank] = good
    dist.destroy_process_group()


def check_te_cp(lengths) -> bool:
    """`attention_backend=te` with CP: TE's THD CP (`hcp.model.te_cp`) on 2 GPUs, bf16, both
    strategies, outputs vs the float64 reference. Skipped (True) without TE or a second GPU."""
    import importlib.util

    import torch.multiprocessing as tmp

    from hcp.launch.launch import free_port

    if importlib.util.find_spec("transformer_engine") is None or torch.cuda.device_count() < 2:
        print(f"te cp attention: skipped (transformer_engine "
              f"{'found' if importlib.util.find_spec('transformer_engine') else 'missing'}, "
              f"{torch.cuda.device_count()} GPU(s); needs both and 2 GPUs)")
        return True
    ok = True
    for comm in ("p2p", "allgather"):
        results, error = tmp.Manager().dict(), ""
        try:
            tmp.spawn(_te_cp_rank, args=(2, free_port(), comm, lengths, results), nprocs=2)
        except Exception as err:  # noqa: BLE001 - a rank's error, printed with the verdict
            error = f": {str(err).strip().splitlines()[-1][:200]}"
        good = len(results) == 2 and all(results.values())
        ok &= good
        print(f"te cp attention cuda bfloat16 cp2 {comm:<9} {'OK' if good else 'FAIL'}{error}")
    return ok


def doc_lengths(tokens: int) -> list[int]:
    """Mixed documents summing to `tokens`: one of tokens/4, then halving lengths, then 512s."""
    lengths, left, n = [], tokens, tokens // 4
    while left > 0:
        take = min(left, max(n, 512))
        lengths.append(take)
        left -= take
        n //= 2
    return lengths


def train_step(device, cfg: LLMConfig, tokens: int, peak_tflops: float) -> None:
    torch.manual_seed(0)
    # the training run's policy: the backend resolves from its compute dtype
    bf16 = Precision.of("bf16")
    with torch.device(device):
        model = LlavaModel(None, None, cfg, attention_backend=resolve_backend(
            cfg.attention_backend, device, bf16.compute))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    lengths = doc_lengths(tokens)
    cu = cu_of(lengths).to(device)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device)
    batch = Batch(ids, torch.roll(ids, -1),
                  torch.cat([torch.arange(n) for n in lengths]).to(device), cu, max(lengths), None,
                  None)
    backend = model.llm.attention_backend  # the one the model runs

    def step():
        with bf16.autocast(device.type):
            loss_sum, n = model(batch)
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum.item() / n

    step()                                           # warm-up: kernels, allocator, AdamW state
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - start
    flops = model_flops(cfg, tokens, float(sum(n * n for n in lengths)))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    print(f"train step: LLaMA {params / 1e9:.2f}B params, {tokens} tokens in {len(lengths)} "
          f"documents (longest {max(lengths)}), bf16 autocast, attention backend {backend}: loss "
          f"{loss:.3f}, {dt:.3f} s, {flops / dt / 1e12:.1f} TFLOP/s, MFU "
          f"{flops / dt / 1e12 / peak_tflops:.1%} of {peak_tflops:g}, peak memory {peak:.1f} GiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model and short documents (dry run)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of the training micro-batch")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 peak of the device")
    ap.add_argument("--skip", default="", help="comma list of checks to skip: attention,train,runs")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device visible: run with --device cpu --tiny for a dry run")
            return 1
        torch.backends.cuda.matmul.allow_tf32 = False    # fp32 checks compare real fp32
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = True
    if "attention" not in args.skip:
        ok = check_attention(device,
                             [96, 7, 33, 1, 20] if args.tiny else [3000, *([200] * 4), 37, 5, 1])
        ok &= check_te_cp([96, 7, 33, 1, 20] if args.tiny else [3000, *([200] * 4), 37, 5, 1])
    if "train" not in args.skip:
        cfg = (LLMConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=128) if args.tiny else
               LLMConfig(vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32,
                         num_kv_heads=4, ffn_hidden_size=5632))
        train_step(device, cfg, 1024 if args.tiny else args.tokens, args.peak_tflops)
    if "runs" not in args.skip:
        import gpu_check_runs

        ok &= gpu_check_runs.main(device, args.tiny)
    print("gpu_check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
