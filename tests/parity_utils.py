"""Shared pieces of the multi-rank parity tests."""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def whole(t: torch.Tensor, p, group) -> torch.Tensor:
    """Parameter `p`'s tensor `t` (its data or gradient) made whole on this rank, a copy: an
    FSDP shard (DTensor) gathered over its mesh, then a TP shard (`p.shard_spec`) gathered over
    `group` along its split dim (a collective over `group`: every rank of it calls it)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    spec = getattr(p, "shard_spec", None)
    if spec is None:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(spec.world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=spec.dim)


def merged(results: list[dict], key: str) -> dict:
    """{name: tensor} of every rank's `results[r][key]` together (stages hold different names;
    TP/DP replicas hold equal whole tensors)."""
    out = {}
    for r in results:
        out.update(r[key])
    return out


def assert_all_close(got: dict, reference: dict, what: str, **tol) -> None:
    """Every tensor of `reference` equals `got`'s of the same name within `tol`; a failure
    names `what` (e.g. `grad`) and the tensor."""
    for key, ref in reference.items():
        torch.testing.assert_close(got[key], ref, **tol, msg=lambda m, key=key: f"{what} {key}: {m}")


def assert_island_ranks(results: list[dict], reference: dict, width: int = 128) -> None:
    """Per rank of a non-colocated step: inputs read only on an encoder island's first stage
    (images) and on the LLM's first stage (text); loss, global counts and clip norm equal the
    single-process `reference` (rel 1e-5); every routed row (fp32, `width` wide) crosses once
    forward from the encoders' last stages and its gradient once back (the minimum). Each
    rank's dict has `reads`, `encoder`, `first`, `loss`, `counts`, `norm`, `route_bytes`
    (sent forward, backward) and `image_rows`."""
    import pytest

    for r in results:
        assert (r["reads"]["images"] > 0) == (r["encoder"] and r["first"])
        assert (r["reads"]["text"] > 0) == (not r["encoder"] and r["first"])
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["counts"] == reference["counts"]
        assert r["norm"] == pytest.approx(reference["norm"], rel=1e-5)
    rows = sum(r["route_bytes"][0] for r in results if r["encoder"]) // (4 * width)
    assert rows == results[0]["image_rows"] > 0
    assert sum(r["route_bytes"][1] for r in results) == sum(r["route_bytes"][0] for r in results)
