"""Rules that find a wrong mask from what the run already states: its config, its arguments, its steps, its cache and
the kernels' own rules; and what trace's report, inspect, attend and pack find in the masks they read (registry.py
lists them all; engine.py runs those that read a trace's run; the others are called by the code that holds what
they read: trace/report.py, inspect/analysis.py, attention/findings.py, pack/findings.py)."""
