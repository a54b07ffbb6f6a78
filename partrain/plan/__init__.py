"""Predictions without starting a process: the layout plan (layout), its memory and time models,
the hardware presets and the layout search."""
