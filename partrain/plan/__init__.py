"""Predictions without starting a process: the layout plan (layout) and its drawing (render), the
memory and time models, the cost formulas they share (costs, torch-free), the hardware presets and
the layout search."""
