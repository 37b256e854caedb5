"""Apply a checkpoint to raw inputs: `python predict.py ckpt_path=PATH data.path=F` (see docs/using-a-model.md)."""

from experiments.commands.entry import command

if __name__ == "__main__":
    command("predict", "experiments.commands.predict:main")()
