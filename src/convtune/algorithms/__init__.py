"""Algorithms: the ways to compute a convolution, and the one registry they live in."""

from .base import Algorithm, Buffer, NumericNotes, Support, allocate_workspace
from .registry import algorithms, get_algorithm, register, registered, unregister, unsupported_reasons

__all__ = [
    "Algorithm", "Buffer", "NumericNotes", "Support", "allocate_workspace",
    "algorithms", "get_algorithm", "register", "registered", "unregister", "unsupported_reasons",
]
