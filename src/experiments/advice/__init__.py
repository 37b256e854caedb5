"""`python advise.py`: which of the seed's knobs pays for this model and data on this machine (docs/advice.md).

plan (what to measure, the options as train.py overrides), stretches (the callback that times a trial's steady
state), trials (a trial: train.py's own run, in this process or as a command), verdicts (each knob's line and the
recommendation), record (the table, advice.json, the plot), command (the spine: `main(cfg)`).
"""
