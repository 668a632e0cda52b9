"""What runs the model: sequences, the paged KV cache, the scheduler, the runner (one batched
forward per call, with static shapes for CUDA graphs) and metrics."""
