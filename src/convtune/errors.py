"""The package's own exception types (misuse raises ValueError/TypeError instead)."""


# What a candidate's own code (an algorithm's supports, buffers, notes, cost, run; a backend's
# algorithms) may raise that is that candidate's failure, never the search's: any Exception, and
# SystemExit (a plug-in calling sys.exit). KeyboardInterrupt and the like are the user's, and propagate.
CANDIDATE_FAULTS: tuple[type[BaseException], ...] = (Exception, SystemExit)


class ConvtuneError(Exception):
    """Base of the errors that tuning itself raises."""


class NoAlgorithmError(ConvtuneError):
    """No registered algorithm can serve the problem under the policy."""
