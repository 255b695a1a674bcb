export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; ln -sfn ../kernels hfpaged/kernels
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_graphs.py tests/test_argmax_kernel.py > $OUT/graphs_tests.log 2>&1; echo "rc=$?"; tail -3 $OUT/graphs_tests.log
