"""FLUX.2 (klein 4B/9B and dev 32B): the adapter, the tiny builder and the real-size configs."""
