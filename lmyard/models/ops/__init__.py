"""The kernels the model families call where a plain op spends memory traffic: the cross-entropy's Triton kernel
(`cross_entropy`), RoPE on stacked qkv (`rope`), cuBLASLt's epilogues through ctypes (`cublaslt`) and
FlashAttention-4 behind SDPA (`flash4`). Each has a torch path for what its kernel does not take."""
