"""Advice for your model on this machine: `python advise.py [train.py's overrides]` (see docs/advice.md)."""

from experiments.commands.entry import command

if __name__ == "__main__":
    command("advise", "experiments.advice.command:main")()
