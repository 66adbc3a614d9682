"""Native CPU kernels that PyTorch's own ops do not match for decoding (see ``gemv``)."""
