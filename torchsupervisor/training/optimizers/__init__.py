"""The ``tf.train`` optimizers that ``torch.optim`` lacks, as ``torch.optim.Optimizer`` subclasses.

The others have PyTorch equivalents (``docs/tf-train-map.md``): ``GradientDescentOptimizer`` is
``torch.optim.SGD``, ``AdamOptimizer`` ``torch.optim.Adam``, and so on.
"""

from __future__ import annotations

from torchsupervisor.training.optimizers.adagrad_da import AdagradDAOptimizer
from torchsupervisor.training.optimizers.ftrl import FtrlOptimizer
from torchsupervisor.training.optimizers.proximal_adagrad import ProximalAdagradOptimizer
from torchsupervisor.training.optimizers.proximal_gradient_descent import (
    ProximalGradientDescentOptimizer,
)

__all__ = [
    "AdagradDAOptimizer",
    "FtrlOptimizer",
    "ProximalAdagradOptimizer",
    "ProximalGradientDescentOptimizer",
]
