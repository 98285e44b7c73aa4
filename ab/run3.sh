source .whl/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
bash scripts/gpu_check.sh fingerprint
timeout 330 python3 ab/trace/sweep2.py 2>&1 | tee $OUT/sweep2.log | grep -v Warning
NBN=128 timeout 120 python3 ab/trace/run_trace.py 2>&1 | tee $OUT/trace128.log | grep -v Warning | head -24
