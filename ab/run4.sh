source .whl/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
bash scripts/gpu_check.sh fingerprint
timeout 400 python3 ab/trace/sweep3.py 2>&1 | tee $OUT/sweep3.log | grep -v Warning
