"""convtune: picks the best convolution algorithm for the hardware at hand, under your constraints."""

from . import background, nn, zoo
from .algorithms import Algorithm, NumericNotes, Support, allocate_workspace, register
from .algorithms.registry import algorithms, get_algorithm, registered, unsupported_reasons
from .db import TuningDB
from .errors import ConvtuneError, NoAlgorithmError
from .find import find
from .get import get
from .plan import InfeasibleBudgetError, Plan, plan
from .policy import Policy
from .problem import ConvProblem, to_layout
from .pytorch.explain import explain
from .pytorch.optimize import optimize
from .results import Choice, PerfResult, Status
from .select import select

__version__ = "0.1.0"

__all__ = [
    "Algorithm", "Choice", "ConvProblem", "ConvtuneError", "NoAlgorithmError", "NumericNotes", "PerfResult",
    "Policy", "Status", "Support", "TuningDB", "algorithms", "allocate_workspace", "get_algorithm", "register",
    "registered", "to_layout", "unsupported_reasons",
    "find", "get", "select", "optimize", "explain", "Plan", "plan", "InfeasibleBudgetError", "nn", "zoo",
    "background",
]
