source .whl/setup.sh
set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
bash scripts/gpu_check.sh fingerprint > $OUT/fp.txt
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -1)
timeout 120 $ncu --clock-control none -k regex:attend_wide --launch-skip 4 --launch-count 1 --set full --import-source yes -f -o $OUT/gluon128 python3 ab/gluon/ncu_wide.py 128 3 > $OUT/ncu-gluon128.log 2>&1
$ncu -i $OUT/gluon128.ncu-rep --page details > $OUT/gluon128.txt 2>&1
$ncu -i $OUT/gluon128.ncu-rep --page source --csv --print-source sass > $OUT/gluon128-sass.csv 2>&1
timeout 120 $ncu --clock-control none -k regex:_attend_items --launch-skip 4 --launch-count 1 --set full --import-source yes -f -o $OUT/triton64 python3 benchmarks/fca_ncu.py --case 4x16 --rows 64 > $OUT/ncu-triton64.log 2>&1
$ncu -i $OUT/triton64.ncu-rep --page details > $OUT/triton64.txt 2>&1
$ncu -i $OUT/triton64.ncu-rep --page source --csv --print-source sass > $OUT/triton64-sass.csv 2>&1
rm -f $OUT/*.ncu-rep
timeout 150 python3 ab/gluon/bench2.py > $OUT/bench2.log 2>&1
if grep -q H200 $OUT/gpu.txt; then
  timeout 170 python3 benchmarks/fca.py > $OUT/fca.log 2>&1
  timeout 150 python3 benchmarks/sampling.py > $OUT/sampling.log 2>&1
fi
ls -la $OUT
