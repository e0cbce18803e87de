"""A perf_analyzer-class load tester: closed-loop concurrency sweeps and open-loop Poisson
request rates against any HTTP endpoint, with stable measurement windows, percentiles, errors
by status, the server-side breakdown from /metrics, the knee and a capacity plan.

`python -m loadtest --help`; the Python entry point is `loadtest.sweep.run_sweep`.
No torch here: the load generator must not compete with the server for more than it needs.
"""
