"""What a run is, decided before any process starts: the typed schema, each key documented where
it is declared (schema), Hydra composition (compose), override and key rules and the key table
(keys), the world, dp and the batch resolved (resolve), the rules (validate, validate_moe), and
the frozen config a run dir holds. Imports no torch."""
