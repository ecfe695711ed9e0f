"""A stand-in for bench/pytorch_gpt.py in the test of bench/cpu_compare.py
(CI has no PyTorch): prints the fields the comparison reads, with a rate
that differs between PyTorch as it runs and `--avx2`, and under torchrun
(its stub, torch/distributed/run.py) the job's world size. `STUB_FAIL=1`
fails it."""
import json, os, sys
if os.environ.get("STUB_FAIL") == "1":
    sys.exit("stub: failing as asked")
avx2 = "--avx2" in sys.argv
if os.environ.get("RANK", "0") != "0":
    sys.exit(0)  # rank 0 prints, as the real script under torchrun
print(json.dumps({"tokens_per_s_median": 1000.0 if avx2 else 2000.0, "ms_per_step_median": 5.0,
                  "final_loss": 3.0, "cpu_capability": "AVX2" if avx2 else "AVX512",
                  "world_size": int(os.environ.get("WORLD_SIZE", "1"))}))
