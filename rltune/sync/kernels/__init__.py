"""Element kernels of weight sync: diff/extract, apply, checksum (Triton) and their torch references."""
