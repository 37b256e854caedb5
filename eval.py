"""Score a checkpoint: `python eval.py ckpt_path=PATH [data.path=F]` (see README.md, "Using a trained model")."""

from experiments.scoring import eval_main

if __name__ == "__main__":
    eval_main()
