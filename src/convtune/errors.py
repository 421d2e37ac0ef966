"""The package's own exception types (misuse raises ValueError/TypeError instead)."""


class ConvtuneError(Exception):
    """Base of the errors that tuning itself raises."""


class NoAlgorithmError(ConvtuneError):
    """No registered algorithm can serve the problem under the policy."""
