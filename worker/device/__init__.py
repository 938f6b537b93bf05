"""Device code: the CUDA path (set-up, decode and prefill graphs, the graphed model), the
Triton kernels (`kernels/`), and the CPU C kernels (`cpu_gemv`)."""
