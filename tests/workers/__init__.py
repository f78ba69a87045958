"""Scripts the tests launch on several processes (torchrun, by path: helpers.multiprocess finds them here); a test
may import one to compute the single-process reference."""
