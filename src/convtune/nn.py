"""convtune.nn: drop-in convolution modules that run the algorithms convtune selects.

    >>> import torch, convtune.nn
    >>> isinstance(convtune.nn.Conv2d(3, 8, 3), torch.nn.Conv2d)
    True
"""

from convtune.pytorch.modules import Conv1d, Conv2d, Conv3d

__all__ = ["Conv1d", "Conv2d", "Conv3d"]
