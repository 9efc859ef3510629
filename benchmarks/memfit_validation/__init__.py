"""The estimator against public measurements: memory (`memory`, its table's schema in `cases`),
step time (`step_time`, its table's schema in `step_time_cases`) and the longest sequences
(`long_context`).

Not part of the library: only the tests, the benchmarks and the docs use these checks, so they
live beside the benchmark scripts (which import them from their own folder; tests/conftest.py
puts benchmarks/ on sys.path) and pyproject.toml does not ship them (its packages are found
under src/ only). The tables stay data files: tests/public_measurements.yaml,
tests/public_throughput.yaml, tests/public_long_context.yaml. Imports memfit (the estimator's
public API and its rooms); memfit never imports this package (tools/check_shape.py).
"""
