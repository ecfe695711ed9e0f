"""A stand-in for torchrun (`python -m torch.distributed.run`) in the test
of bench/cpu_compare.py: reads `--nproc-per-node N` and `--master-port`
and runs the script once, as rank 0 of N (`WORLD_SIZE`, `RANK`,
`LOCAL_RANK`, `MASTER_PORT` set as torchrun sets them), which is all the
stub scripts need to say they ran as a job."""
import os
import runpy
import sys

args = sys.argv[1:]
env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}
while args and args[0].startswith("--"):
    flag, value, args = args[0], args[1], args[2:]
    key = {"--nproc-per-node": "WORLD_SIZE", "--master-port": "MASTER_PORT"}.get(flag)
    if key is None:
        sys.exit(f"torchrun stub: {flag} is not a flag it knows")
    env[key] = value
os.environ.update(env)
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
