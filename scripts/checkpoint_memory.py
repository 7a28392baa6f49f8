"""Peak memory of one rank's checkpoint save and resume next to its training step's, without a GPU
(`hcp.preflight.rehearse.checkpoint_memory`: the rank built and stepped under fake tensors).

    python scripts/checkpoint_memory.py --rank 0 +recipe=llava_hetero llm.layout.dp_shard=true \
        trainer.global_batch_size=64

prints, in GiB, the bytes held between steps (weights, Adam's moments), the training step's peak
and the save's and the resume's, with their ratio to the training peak (a save or a resume is
within budget at most 1.10 of it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2 ** 30


def main(argv=None) -> dict:
    """Parse `argv` (`--rank R` and Hydra overrides), measure, print; return the figures."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=0,
                        help="the rank whose role is measured (default 0)")
    parser.add_argument("--run-dir", default=None, help="where the data and the empty checkpoint "
                        "folder go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as train.py takes them")
    args = parser.parse_args(argv)

    from hcp.config.compose import compose_config
    from hcp.config.layouts import world_size_of
    from hcp.config.specs import resolve_modules
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.launch.launch import resolve_nproc
    from hcp.preflight.rehearse.checkpoint_memory import checkpoint_peaks
    from hcp.preflight.rehearse.runner import rehearsal_config

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="hcp-checkpoint-memory-")
    cfg = compose_config(["mode=rehearse", *args.overrides], run_dir=run_dir)
    world = world_size_of(cfg, resolve_nproc("auto"))
    for line in prepare_data(cfg, resolve_modules(cfg, validate(cfg, world))):
        print(line)
    peaks = checkpoint_peaks(rehearsal_config(cfg), run_dir, args.rank, world)
    print(f"rank {args.rank} of {world} ({' '.join(args.overrides)}), GiB:")
    print(f"  held between steps  {peaks['held'] / GIB:8.2f}")
    for key in ("train", "save", "resume"):
        print(f"  {key + ' peak':<18}  {peaks[key] / GIB:8.2f}  {peaks[key] / peaks['train']:.2f}x "
              f"training")
    return peaks


if __name__ == "__main__":
    main()
