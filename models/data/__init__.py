"""Data for the examples and tests: MNIST-style images and byte-level text."""
