"""GPU kernels. Each has a Triton implementation, a plain-torch reference with the same semantics,
and a dispatcher that picks Triton for CUDA tensors and the reference elsewhere."""
