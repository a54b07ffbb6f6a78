"""JSON objects read with each key once: DeepSpeed refuses a key given twice in its config, and
pyarrow a JSON Lines record with one; json.loads keeps the last silently. For a ds_config.json
(config/ds_file.py) and the line named in a JSON Lines refusal (data/inputs.py)."""


class KeyGivenTwice(ValueError):
    """args[0]: the key."""


def once_each(pairs: list) -> dict:
    """An object_pairs_hook (json, hjson): the object, or KeyGivenTwice naming its repeated key."""
    found = {}
    for key, value in pairs:
        if key in found:
            raise KeyGivenTwice(key)
        found[key] = value
    return found
