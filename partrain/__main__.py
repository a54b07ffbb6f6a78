"""`python -m partrain` is the same as the `partrain` command."""

from partrain.cli import console

if __name__ == "__main__":
    console()
