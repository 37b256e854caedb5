"""The models a run can train (conf/model/): the seed's `torch.nn.Linear`, and the MLP family (mlp.py)."""

# model.activation's names, torch-free: the config's rules (experiments.config.rules) check them before torch loads.
ACTIVATIONS = ("relu", "gelu", "tanh", "silu")
