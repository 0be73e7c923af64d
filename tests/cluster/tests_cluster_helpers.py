"""Functions the tests run inside actors (shipped by value with ray.cloudpickle.register_pickle_by_value)."""

import time


def stall(engines, seconds: float) -> None:
    """An unresponsive stage: sleeps instead of answering."""
    time.sleep(seconds)
