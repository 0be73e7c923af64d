"""Pure math of diffusion RL: SDE steps with log-probs, windows, advantages, losses, bundles.

Imports only torch. See docs/algorithms.md for formulas, papers, defaults and deviations.
"""
