"""Drivers that measure the product's RL step and its parts; each writes a JSON result with its device and command.

Run one from the repository root as a module, e.g. `python -m benchmarks.rl_step --help`: the drivers import diffrl
(installed) and their shared helpers as `benchmarks.common`, so no driver changes the import path.
"""
