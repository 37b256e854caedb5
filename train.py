"""Train the seed's model: `python train.py [overrides]` (see README.md)."""

from experiments.train import main

if __name__ == "__main__":
    main()
