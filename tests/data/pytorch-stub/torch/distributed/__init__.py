"""A stand-in package, only for `python -m torch.distributed.run` in the
test of bench/cpu_compare.py (CI has no PyTorch); see distributed/run.py."""
