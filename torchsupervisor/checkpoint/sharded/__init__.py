"""Sharded checkpoints (FSDP2 / DTensor): every rank writes its part under one commit protocol.

``collective`` saves and restores a sharded state with ``torch.distributed.checkpoint`` as the
planning engine; ``storage`` is DCP's storage half, writing and reading our format; ``metadata``
is the manifest's sharded part.
"""
