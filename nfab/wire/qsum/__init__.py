"""qsum: stochastically rounded levels packed into integer lanes and summed exactly; lanes and lane kernels."""
