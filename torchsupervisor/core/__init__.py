"""The core: no files, no process groups.

Time (``clock``), the ``Coordinator`` and its ``LooperThread``, timers, the collections registry
(the one ``USE_DEFAULT``), the global step, the step boundary, the ``Session``, the state (flatten,
load, check), RNG state, variable initializers, background-thread priority and argument checks.
Everything above (checkpoints, drivers, front ends) builds on these; nothing here imports them.
"""
