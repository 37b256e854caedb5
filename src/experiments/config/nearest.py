"""The keys nearest to one that the config does not have (`trainer.devics`): "did you mean trainer.devices?"."""

from difflib import SequenceMatcher

from omegaconf import DictConfig, OmegaConf

# How alike two key names must be (difflib's ratio, 0 to 1) to be offered: devics/devices 0.92, bach_size/batch_size
# 0.95, momentom/momentum 0.88; nope/num_nodes 0.46 is not a typo of it.
ALIKE = 0.75


def config_keys(cfg: DictConfig | None) -> list[str]:
    """Every key of `cfg`, dotted (`trainer`, `trainer.devices`), in the config's order; none for None."""
    if cfg is None:
        return []

    def walk(node, prefix: str) -> list[str]:
        keys = []
        for key, value in node.items():
            path = f"{prefix}{key}"
            keys.append(path)
            if isinstance(value, dict):
                keys += walk(value, f"{path}.")
        return keys

    return walk(OmegaConf.to_container(cfg, resolve=False), "")


def nearest_keys(key: str, keys: list[str], most: int = 3) -> list[str]:
    """The keys whose last name is most like `key`'s (the same parent first among equals), at most `most`.

    difflib's get_close_matches compares whole strings: the shared `trainer.` of `trainer.nope` and
    `trainer.num_nodes` would make them alike, so names are compared by their last part here."""
    parent, _, name = key.rpartition(".")

    def likeness(other: str) -> tuple[float, bool]:
        other_parent, _, other_name = other.rpartition(".")
        return SequenceMatcher(None, name, other_name).ratio(), other_parent == parent

    ranked = sorted(
        ((likeness(k), k) for k in keys if k != key and not k.rsplit(".", 1)[-1].startswith("_")),
        key=lambda pair: pair[0],
        reverse=True,
    )
    return [k for (ratio, _), k in ranked[:most] if ratio >= ALIKE]
