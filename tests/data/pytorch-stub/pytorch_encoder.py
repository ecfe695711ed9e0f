"""A stand-in for bench/pytorch_encoder.py in the test of
bench/cpu_compare.py (CI has no PyTorch)."""
import json, sys
avx2 = "--avx2" in sys.argv
print(json.dumps({"samples_per_s_median": 10.0 if avx2 else 20.0, "ms_per_step_median": 50.0,
                  "final_loss": 1.0, "cpu_capability": "AVX2" if avx2 else "AVX512"}))
