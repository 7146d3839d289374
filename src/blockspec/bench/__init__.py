"""`blockspec bench`: tau, speed-up and calibration of every method (docs/design.md section 11).

arms (what runs: one runner per method and block size) -> measure (interleaved timed
runs, calibration, engine throughput) -> report (rows, Markdown, JSON, plots) ->
run (`run_bench`, the orchestration) -> cli (the `blockspec bench` parser).
datasets, metrics (report helpers), quality (degeneracy, parses-with-a-body) and plots
are their leaves.
"""
