"""Where the shipped configs/ and recipes/ are, in a wheel or in a source checkout."""

from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # the partrain package


def _find(name: str) -> Path:
    # In a wheel they sit inside the package (pyproject's force-include); in a checkout or an
    # editable install they sit beside it, at the top of the repository.
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"partrain's {name}/ directory is missing from {_PKG}")


def configs_dir() -> Path:
    return _find("configs")


def recipes_dir() -> Path:
    return _find("recipes")
