import pytest
import torch

from arctic_rl_core.weight_sync import CudaIpcSender, load_shared_buckets
from arctic_rl_core.weight_sync.cuda_ipc import CPU_REFUSAL


def test_cuda_ipc_refuses_weights_that_are_not_on_a_gpu():
    with pytest.raises(ValueError) as info:
        CudaIpcSender([("w", torch.zeros(4))], bucket_size=1024)
    assert str(info.value).startswith("cuda_ipc=True needs CUDA; use cuda_ipc=False (file path)")
    assert CPU_REFUSAL == "cuda_ipc=True needs CUDA; use cuda_ipc=False (file path)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a process without CUDA")
def test_cuda_ipc_receiver_refuses_without_cuda():
    with pytest.raises(ValueError, match="cuda_ipc=True needs CUDA; use cuda_ipc=False"):
        load_shared_buckets([], lambda weights: None)
