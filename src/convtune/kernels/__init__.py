"""convtune's own GPU kernels, written in Triton: one family per module.

Nothing here is imported by ``import convtune``: an algorithm that runs one of these kernels
imports its module on first use, so Triton is loaded only when its kernels are asked for.
"""
