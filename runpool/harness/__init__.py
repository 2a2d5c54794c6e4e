"""runpool.harness: what runs on top of the pool to show and measure it — the benchmarks
(`python -m runpool bench`), the soak (`bench --soak`), the demo and its sample agent.

Not part of the library: the pool never imports it, and its modules may change freely.
"""
