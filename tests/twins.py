"""Plain PyTorch copies of convtune models, to compare against."""

import copy

import torch


def torch_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A plain torch copy of a (convtune or torch) model, with equal parameters."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        for cls in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
            if isinstance(m, cls):
                m.__class__ = cls
    return twin
