"""Train the seed's model: `python train.py [overrides]` (see README.md)."""

import sys

from experiments.commands.entry import command
from experiments.distributed.ranks import silent_rank_overrides

if __name__ == "__main__":
    # Ranks > 0 (started by Lightning, torchrun or SLURM) run Hydra too: keep them from writing anything.
    sys.argv += silent_rank_overrides(sys.argv[1:])
    command("config", "experiments.commands.train:main")()
