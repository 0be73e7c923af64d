"""diffrl: reinforcement-learning post-training for diffusion, flow-matching and omni models.

Layers, each importing only the ones before it: `diffrl.algorithms` (pure math) <- `diffrl.models` (adapters)
<- `diffrl.engines` (state: rollout, trainer, rewards, store) <- `diffrl.tasks` (Prefect tasks) <- `diffrl.flows`
(Prefect flows and the `diffrl` command). `diffrl.configs` holds the typed schema and the shipped recipes.
"""

__version__ = "0.1.0"
