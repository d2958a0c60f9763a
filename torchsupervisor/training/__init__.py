"""The rest of TF's training library: learning-rate decay, moving averages, optimizers, clipping.

PyTorch already has most of the ``tf.train`` optimizers and helpers (``docs/tf-train-map.md``
says where each name lives). This package holds the few it lacks, with TF 1's semantics, as
ordinary ``torch.optim`` citizens:

- ``learning_rate_decay``: ``exponential_decay``, ``inverse_time_decay``, ``natural_exp_decay``,
  ``piecewise_constant``, ``polynomial_decay`` as functions of the global step, and
  ``GlobalStepLR``, a ``torch.optim.lr_scheduler`` that follows the (restored) global step.
- ``moving_averages``: ``ExponentialMovingAverage``, checkpointed with the state, and
  ``variables_to_restore()`` for evaluating with the averaged weights through a ``Saver``.
- ``optimizers``: ``FtrlOptimizer``, ``ProximalGradientDescentOptimizer``,
  ``ProximalAdagradOptimizer``, ``AdagradDAOptimizer``, ``RMSPropOptimizer`` (TF's exact update)
  (``torch.optim.Optimizer`` subclasses).
- ``clip_ops``: ``clip_by_value``, ``clip_by_norm``, ``clip_by_average_norm``,
  ``clip_by_global_norm``, ``global_norm`` with TF's return values.

TF name: the corresponding parts of ``tf.train`` (and ``tf.clip_by_*``).
"""
