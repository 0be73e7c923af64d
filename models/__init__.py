"""Model adapters, one file per architecture. Importing this package registers all of them."""
# Each architecture file registers itself with models.base.register_adapter on import.
