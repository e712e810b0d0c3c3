"""Rules that find a wrong mask from what the run already states: its config, its arguments, its steps, its cache and
the kernels' own rules (registry.py lists them; engine.py runs them over a trace)."""
