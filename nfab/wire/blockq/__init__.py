"""Block-scaled qsum: one scale per block, levels summed exactly in radix lanes; reference, scatter and kernels."""
