"""A model module that ends the process as it is imported (model.target=...:build)."""

import sys

sys.exit(3)
