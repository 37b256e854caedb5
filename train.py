"""Train the seed's model: `python train.py [overrides]` (see README.md)."""

import sys

from experiments.strategies import silent_rank_overrides
from experiments.train import main

if __name__ == "__main__":
    # Ranks > 0 (started by Lightning, torchrun or SLURM) run Hydra too: keep them from writing anything.
    sys.argv += silent_rank_overrides(sys.argv[1:])
    main()
