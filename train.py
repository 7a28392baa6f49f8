"""hcp entry point (the same as the `hcp-train` command of an installed package).

    python train.py                                   # tiny LLaVA on digits, 4 local ranks
    python train.py +recipe=llava_hetero mode=plan    # plan a full-size run, no GPU needed
    python train.py -m optim.lr=1e-3,3e-3             # a sweep: one run directory per job
    torchrun --nproc-per-node 8 train.py ...          # joins the ranks torchrun started
"""
from hcp.entry import main

if __name__ == "__main__":
    main()
