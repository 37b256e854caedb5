"""Apply a checkpoint to raw inputs: `python predict.py ckpt_path=PATH data.path=F` (see README.md)."""

from experiments.scoring import predict_main

if __name__ == "__main__":
    predict_main()
