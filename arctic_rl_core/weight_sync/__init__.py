"""Weight sync from training to sampling.

- colocated, weights on GPU: CUDA IPC (``cuda_ipc``) of the weights' own flat
  storages or of flattened buckets, optionally one bucket at a time
  (``low_memory``), in a session that later syncs reuse;
- colocated, training offloaded: safetensors files (``file_sync``);
- split placement: ``WeightSyncCoordinator`` (NCCL on GPU, gloo on CPU), with
  tensor-parallel resharding for the inference replicas.

Every path checks names and shapes on the receiver and refuses a mismatch.
"""

from arctic_rl_core.weight_sync.buckets import BucketLayout, TensorSlot, pack_bucket, plan_buckets, unpack_bucket
from arctic_rl_core.weight_sync.coordinator import WeightSyncCoordinator
from arctic_rl_core.weight_sync.cuda_ipc import (
    CudaIpcSender,
    IpcMappings,
    IpcSession,
    SharedBucket,
    check_layouts,
    load_shared_buckets,
    receive_over_connection,
    send_over_connection,
)
from arctic_rl_core.weight_sync.errors import WeightMismatchError, WeightSyncError
from arctic_rl_core.weight_sync.file_sync import read_weights, write_weights
from arctic_rl_core.weight_sync.flat_shards import FlatShard, flat_partition
from arctic_rl_core.weight_sync.schedule import InferenceTarget, TrainingRank, TransferSchedule
from arctic_rl_core.weight_sync.tp_resharding import AttentionHeads, tp_shard, tp_shard_shape
from arctic_rl_core.weight_sync.validation import check_shapes, module_shapes

__all__ = [
    "AttentionHeads",
    "BucketLayout",
    "CudaIpcSender",
    "FlatShard",
    "InferenceTarget",
    "IpcMappings",
    "IpcSession",
    "SharedBucket",
    "TensorSlot",
    "TrainingRank",
    "TransferSchedule",
    "WeightMismatchError",
    "WeightSyncCoordinator",
    "WeightSyncError",
    "check_layouts",
    "check_shapes",
    "flat_partition",
    "load_shared_buckets",
    "module_shapes",
    "pack_bucket",
    "plan_buckets",
    "read_weights",
    "receive_over_connection",
    "send_over_connection",
    "tp_shard",
    "tp_shard_shape",
    "unpack_bucket",
    "write_weights",
]
