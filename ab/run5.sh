source .whl/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
bash scripts/gpu_check.sh fingerprint; git log -1 --format='%h %s' | cut -c1-80
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fca_kernel.py tests/gpu/test_native_engine_gpu.py 2>&1 | tail -4 | tee $OUT/tests.log
timeout 200 python3 benchmarks/fca.py 2>&1 | grep -v Warning | tee $OUT/fca.log
timeout 60 python3 ab/trace/run_trace.py 2>&1 | grep -v Warning | head -22 | tee $OUT/trace.log
