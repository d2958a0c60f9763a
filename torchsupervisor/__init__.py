"""torchsupervisor: TensorFlow 1's training Supervisor, rebuilt for PyTorch.

A flat namespace like ``tf.train``: ``Supervisor``, ``Coordinator``, ``Saver``,
``SummaryWriter``, ``SessionManager``, ... plus the modules ``torchsupervisor.summary`` and
``torchsupervisor.errors``. Importing the package has no side effects.
"""

from torchsupervisor import distributed, errors, hooks, interop, logging, summary
from torchsupervisor._version import __version__
from torchsupervisor.checkpoint.files import (
    checkpoint_exists,
    get_checkpoint_mtimes,
    remove_checkpoint,
)
from torchsupervisor.checkpoint.reader import (
    CheckpointReader,
    NewCheckpointReader,
    list_variables,
    load_checkpoint,
    load_variable,
)
from torchsupervisor.checkpoint.saver import Saver
from torchsupervisor.checkpoint.sharded.collective import load_sharded, save_sharded
from torchsupervisor.checkpoint.sharded.plan import ShardedOptimizerState
from torchsupervisor.checkpoint.state_file import (
    CheckpointState,
    generate_checkpoint_state_proto,
    get_checkpoint_state,
    latest_checkpoint,
    update_checkpoint_state,
)
from torchsupervisor.core.clock import Clock
from torchsupervisor.core.coordinator import Coordinator, LooperThread
from torchsupervisor.core.global_step import (
    GlobalStep,
    assert_global_step,
    create_global_step,
    get_global_step,
    get_or_create_global_step,
    global_step,
)
from torchsupervisor.core.registry import (
    Graph,
    GraphKeys,
    add_to_collection,
    add_to_collections,
    clear_collection,
    get_collection,
    get_collection_ref,
    get_default_graph,
    reset_default_graph,
)
from torchsupervisor.core.rng import RNGState
from torchsupervisor.core.session import Session
from torchsupervisor.core.timers import SecondOrStepTimer
from torchsupervisor.core.variables import (
    global_variables_initializer,
    local_variables_initializer,
    report_uninitialized_variables,
)
from torchsupervisor.distributed.cluster import ClusterSpec, Server
from torchsupervisor.driver.preemption import (
    DEFAULT_PREEMPTION_SIGNALS,
    IgnorePreemptionSignals,
    PreemptionHandler,
)
from torchsupervisor.driver.preemption_sources import (
    AwsSpotNotice,
    AzureScheduledEvents,
    GcePreemptedNotice,
    PreemptionNotice,
    SlurmTimeLimit,
)
from torchsupervisor.driver.requeue import SlurmRequeue
from torchsupervisor.hooks import *  # noqa: F403 (every hook; hooks.__all__)
from torchsupervisor.input.batching import (
    batch,
    batch_join,
    maybe_batch,
    maybe_batch_join,
    maybe_shuffle_batch,
    maybe_shuffle_batch_join,
    shuffle_batch,
    shuffle_batch_join,
)
from torchsupervisor.input.data import ResumableDataLoader, ResumableSampler
from torchsupervisor.input.ops import limit_epochs, py_func
from torchsupervisor.input.pipeline_state import InputPipelineState
from torchsupervisor.input.producers import (
    input_producer,
    range_input_producer,
    slice_input_producer,
    string_input_producer,
)
from torchsupervisor.input.queue import FIFOQueue, QueueBase
from torchsupervisor.input.queue_runner import (
    QueueRunner,
    add_queue_runner,
    queue_from_iterable,
    start_queue_runners,
)
from torchsupervisor.input.queues import PaddingFIFOQueue, PriorityQueue, RandomShuffleQueue
from torchsupervisor.input.readers import (
    FixedLengthRecordReader,
    ReaderBase,
    TextLineReader,
    TFRecordReader,
    WholeFileReader,
    decode_raw,
)
from torchsupervisor.monitored.creators import (
    ChiefSessionCreator,
    SessionCreator,
    WorkerSessionCreator,
)
from torchsupervisor.monitored.scaffold import Scaffold
from torchsupervisor.monitored.session import (
    MonitoredSession,
    SingularMonitoredSession,
    StepContext,
)
from torchsupervisor.monitored.sharded_creator import ShardedSessionCreator
from torchsupervisor.monitored.training_session import MonitoredTrainingSession
from torchsupervisor.summary import (
    FileWriter,
    FileWriterCache,
    NullSummaryWriter,
    SummaryWriter,
    SummaryWriterCache,
    summary_iterator,
)
from torchsupervisor.supervisor.session_manager import SessionManager
from torchsupervisor.supervisor.supervisor import Supervisor
from torchsupervisor.supervisor.train_loop import basic_train_loop
from torchsupervisor.tiers.local_disk import LocalDiskConfig
from torchsupervisor.tiers.memory import MemoryTierConfig
from torchsupervisor.training.clip_ops import (
    clip_by_average_norm,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
)
from torchsupervisor.training.learning_rate_decay import (
    GlobalStepLR,
    exponential_decay,
    inverse_time_decay,
    natural_exp_decay,
    piecewise_constant,
    piecewise_constant_decay,
    polynomial_decay,
)
from torchsupervisor.training.moving_averages import ExponentialMovingAverage
from torchsupervisor.training.optimizers import (
    AdagradDAOptimizer,
    FtrlOptimizer,
    ProximalAdagradOptimizer,
    ProximalGradientDescentOptimizer,
    RMSPropOptimizer,
)

__all__ = [
    *hooks.__all__,
    "DEFAULT_PREEMPTION_SIGNALS",
    "AdagradDAOptimizer",
    "AwsSpotNotice",
    "AzureScheduledEvents",
    "CheckpointReader",
    "CheckpointState",
    "ChiefSessionCreator",
    "Clock",
    "ClusterSpec",
    "Coordinator",
    "ExponentialMovingAverage",
    "FIFOQueue",
    "FileWriter",
    "FileWriterCache",
    "FtrlOptimizer",
    "GcePreemptedNotice",
    "GlobalStep",
    "GlobalStepLR",
    "Graph",
    "GraphKeys",
    "IgnorePreemptionSignals",
    "InputPipelineState",
    "LooperThread",
    "MonitoredSession",
    "MonitoredTrainingSession",
    "NewCheckpointReader",
    "PaddingFIFOQueue",
    "PreemptionHandler",
    "PreemptionNotice",
    "PriorityQueue",
    "ProximalAdagradOptimizer",
    "ProximalGradientDescentOptimizer",
    "RMSPropOptimizer",
    "QueueBase",
    "QueueRunner",
    "RNGState",
    "RandomShuffleQueue",
    "ResumableDataLoader",
    "ResumableSampler",
    "Saver",
    "Scaffold",
    "SecondOrStepTimer",
    "Server",
    "Session",
    "SessionCreator",
    "SessionManager",
    "ShardedOptimizerState",
    "ShardedSessionCreator",
    "SingularMonitoredSession",
    "SlurmRequeue",
    "SlurmTimeLimit",
    "StepContext",
    "LocalDiskConfig",
    "MemoryTierConfig",
    "NullSummaryWriter",
    "SummaryWriter",
    "SummaryWriterCache",
    "Supervisor",
    "WorkerSessionCreator",
    "__version__",
    "add_queue_runner",
    "add_to_collection",
    "add_to_collections",
    "assert_global_step",
    "basic_train_loop",
    "batch",
    "batch_join",
    "checkpoint_exists",
    "clear_collection",
    "clip_by_average_norm",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "create_global_step",
    "distributed",
    "errors",
    "interop",
    "logging",
    "exponential_decay",
    "generate_checkpoint_state_proto",
    "get_checkpoint_mtimes",
    "get_checkpoint_state",
    "get_collection",
    "get_collection_ref",
    "get_default_graph",
    "get_global_step",
    "get_or_create_global_step",
    "global_norm",
    "global_step",
    "global_variables_initializer",
    "input_producer",
    "inverse_time_decay",
    "latest_checkpoint",
    "limit_epochs",
    "list_variables",
    "load_checkpoint",
    "load_sharded",
    "load_variable",
    "local_variables_initializer",
    "maybe_batch",
    "maybe_batch_join",
    "maybe_shuffle_batch",
    "maybe_shuffle_batch_join",
    "natural_exp_decay",
    "piecewise_constant",
    "piecewise_constant_decay",
    "polynomial_decay",
    "py_func",
    "queue_from_iterable",
    "range_input_producer",
    "remove_checkpoint",
    "report_uninitialized_variables",
    "reset_default_graph",
    "save_sharded",
    "shuffle_batch",
    "shuffle_batch_join",
    "slice_input_producer",
    "start_queue_runners",
    "string_input_producer",
    "summary",
    "summary_iterator",
    "update_checkpoint_state",
    "FixedLengthRecordReader",
    "ReaderBase",
    "TextLineReader",
    "TFRecordReader",
    "WholeFileReader",
    "decode_raw",
]
