source .whl/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 ab/trace/run_trace.py 2>&1 | tee $OUT/trace.log | grep -v Warning
