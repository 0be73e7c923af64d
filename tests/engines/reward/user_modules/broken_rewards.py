"""A user's reward module whose own import fails: a dependency it needs is missing."""

import no_such_dependency_for_diffrl_tests  # noqa: F401


def score(images, prompts, metadata):
    return [0.0] * len(images)
