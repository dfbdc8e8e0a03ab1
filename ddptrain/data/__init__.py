"""Data: the resumable sharded sampler, evaluation shards, the partitioner, IDX datasets."""

from ddptrain.data.datasets import download_mnist, fashion_mnist, mnist
from ddptrain.data.download import DownloadError
from ddptrain.data.idx import IDXDataset, IDXFormatError, read_idx
from ddptrain.data.partitioner import DataPartitioner, Partition, partition_indices
from ddptrain.data.sampler import (
    EvalSampler,
    MicroBatchSampler,
    ShardedSampler,
    eval_shard,
    global_order,
)

__all__ = [
    "DataPartitioner",
    "DownloadError",
    "EvalSampler",
    "IDXDataset",
    "IDXFormatError",
    "MicroBatchSampler",
    "Partition",
    "ShardedSampler",
    "download_mnist",
    "eval_shard",
    "fashion_mnist",
    "global_order",
    "mnist",
    "partition_indices",
    "read_idx",
]
