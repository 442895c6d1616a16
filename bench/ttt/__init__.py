"""Time to solution (``bench/bench_ttt.py``), split by concern.

- ``problems``: the cases and their inputs;
- ``judge``: float64 marginal errors, dual values and the fields that judge a row;
- ``timing``: the timing protocol, time budgets and iteration caps, device names;
- ``providers``: one worker per provider (and the reference), run in a subprocess;
- ``worker``: the subprocess side; ``driver``: the parent that runs the items and writes
  the results.
"""
