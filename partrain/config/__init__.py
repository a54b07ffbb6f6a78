"""What a run is, decided before any process starts: the typed schema (schema), Hydra
composition (compose), override and key rules (keys), resolution and validation (validate), and
the frozen config a run dir holds. Imports no torch."""
