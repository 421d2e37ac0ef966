"""The package's own exception types (misuse raises ValueError/TypeError instead)."""


class ConvtuneError(Exception):
    """Base of the errors that tuning itself raises."""


class NoAlgorithmError(ConvtuneError):
    """No registered algorithm can serve the problem under the policy."""


class AlgorithmError(ConvtuneError):
    """An algorithm failed for a reason not covered by a status; names the algorithm and problem."""


class WorkspaceTooSmallError(ValueError):
    """The workspace handed to an algorithm is smaller than it declared."""
