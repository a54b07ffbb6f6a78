"""A training script's module that parses its command line as it is imported: it reads
partrain's arguments (model.target=...:build)."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()


def build(model_cfg):
    raise AssertionError("never reached")
