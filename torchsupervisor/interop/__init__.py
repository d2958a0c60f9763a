"""Checkpoints of other tools: TF 1 tensor bundles read without TensorFlow (``tf_bundle``,
``tf_table``) and restored into a torch state through a name map (``tf_restore``).

Importing it registers TF 1 bundles with ``NewCheckpointReader`` (``checkpoint.reader``'s
``register_format``): ``load_checkpoint``, ``list_variables`` and ``load_variable`` read them.

TF name: none.
"""

from torchsupervisor.checkpoint.index_file import register_format
from torchsupervisor.interop.tf_bundle import TFBundleReader
from torchsupervisor.interop.tf_restore import (
    TFRestoreReport,
    conv1d_kernel,
    conv2d_kernel,
    conv2d_transpose_kernel,
    conv3d_kernel,
    dense_kernel,
    restore_tf_checkpoint,
)
from torchsupervisor.interop.tf_table import is_table

__all__ = [
    "TFBundleReader",
    "TFRestoreReport",
    "conv1d_kernel",
    "conv2d_kernel",
    "conv2d_transpose_kernel",
    "conv3d_kernel",
    "dense_kernel",
    "restore_tf_checkpoint",
]

register_format(is_table, TFBundleReader)
