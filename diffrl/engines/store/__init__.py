"""Storage: Lance trajectory tables (trajectories.py), prompt datasets (prompts.py), the prompt-
embedding cache (embeddings.py) and fsspec paths (fs.py). docs/concepts.md#storage explains the layout."""
