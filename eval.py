"""Score a checkpoint: `python eval.py ckpt_path=PATH [data.path=F]` (see docs/using-a-model.md)."""

from experiments.commands.entry import command

if __name__ == "__main__":
    command("eval", "experiments.commands.evaluate:main", checked=("ckpt_path", "trainer"))()
