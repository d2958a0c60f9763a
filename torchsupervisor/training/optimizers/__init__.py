"""The ``tf.train`` optimizers that ``torch.optim`` lacks, as ``torch.optim.Optimizer`` subclasses.

The others have PyTorch equivalents (``docs/tf-train-map.md``): ``GradientDescentOptimizer`` is
``torch.optim.SGD``, ``AdamOptimizer`` ``torch.optim.Adam``, and so on. ``RMSPropOptimizer`` is
here too: ``torch.optim.RMSprop`` computes another update.
"""

from __future__ import annotations

from torchsupervisor.training.optimizers.adagrad_da import AdagradDAOptimizer
from torchsupervisor.training.optimizers.ftrl import FtrlOptimizer
from torchsupervisor.training.optimizers.proximal_adagrad import ProximalAdagradOptimizer
from torchsupervisor.training.optimizers.proximal_gradient_descent import (
    ProximalGradientDescentOptimizer,
)
from torchsupervisor.training.optimizers.rmsprop import RMSPropOptimizer

__all__ = [
    "AdagradDAOptimizer",
    "FtrlOptimizer",
    "ProximalAdagradOptimizer",
    "ProximalGradientDescentOptimizer",
    "RMSPropOptimizer",
]
