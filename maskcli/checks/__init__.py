"""The one set of rules every mask is checked by: a mask comes in (described, given, captured, or implied by metadata),
becomes one Mask on absolute positions, is checked here, and goes out as a view; each rule makes maskcli.text.Findings.

Rules find a wrong mask from what the run already states: its config, its arguments, its steps, its cache and the
kernels' own rules; and what trace's report, inspect, attend, pack, shard and serve find in the masks and metadata they
read (registry.py lists them all, and its run() calls every rule given what the caller holds: a trace group, a
tensor, a packed batch, one serving batch, a shard layout or split; engine.py runs those that read a trace's run; the
code that holds what they read asks run() and imports no rule: trace/report.py, inspect/analysis.py,
attention/findings.py, pack/findings.py, shard/, checks/servecheck.py). docs/architecture.md draws the whole flow.
"""
