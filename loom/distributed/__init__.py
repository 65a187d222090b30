"""Tensor parallelism over processes: torch.distributed (gloo on the CPU, NCCL on CUDA).

tensor_parallel.py slices a loaded model for one rank; executor.py starts the worker
processes and drives them from the engine (one scheduler; every rank executes the same
SchedulerOutput, which rank 0 sends each step).
"""
