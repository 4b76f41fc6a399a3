"""Sign codecs: 1-bit votes counted exactly (signcount, signgather, signscatter) and their compiled CPU kernels."""
