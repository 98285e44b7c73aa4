source .whl/setup.sh >/dev/null 2>&1
bash scripts/gpu_check.sh fingerprint
timeout 330 python3 ab/nar/ab.py 2>&1 | tee $OUT/ab.log | grep -v Warning
for v in "trig0||1" "base|narrow_prefetch=True|0.6" "trig0|narrow_prefetch=True|0.6"; do
  IFS='|' read VARIANT TILES NARROW_STEP <<< "$v"
  export VARIANT TILES NARROW_STEP
  timeout 100 python3 ab/trace/run_trace.py 2>&1 | tee $OUT/trace-$VARIANT-$NARROW_STEP.log | grep -v "late program"
done
