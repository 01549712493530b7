# Sourced by every one-call device script: install the carried wheelhouse and TE, set the environment
# (NVLink multicast stays off, as the lent machines require), and print what the GPUs read now.
# Carry `.device` (wheels, xprof stub, te_h200_bundle.tar.xz), built as shared/device/README.md says.
# A second script in the same call finds both installed and skips the work.
python3 -c "import maxtext" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .device/wheels/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/.device/xprof-stub DECOUPLE_GCLOUD=TRUE PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
TE_ROOT=${TE_ROOT:-/opt/te}
[ -f "$TE_ROOT/activate.sh" ] ||
  python3 -c "import tarfile;tarfile.open('.device/te_h200_bundle.tar.xz').extractall('$TE_ROOT',filter='tar')" || exit 1
# shellcheck disable=SC1091  # unpacked just above
source "$TE_ROOT/activate.sh"
# TE finds cuDNN by a search of its own (CUDNN_HOME first, then CUDA_HOME and /usr/local/cuda); left to it on this
# image, its attention check failed with CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED at every shape
# (docs/results/attention_h200_2026-12-04_call1_te_s4096_cudnn_sublibrary_failed.txt). Pointed at the pip cuDNN that
# JAX loads, TE's fused attention runs MLA's 192/128 head dims.
CUDNN_HOME=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])") && export CUDNN_HOME
# FlashAttention-3 for MLA (attention.kernel: fa3), when scripts/device/build_fa3_carry.sh built it here.
FA3_ARCHIVE=${FA3_ARCHIVE:-.device/fa3/fa3_h200.tar.xz} FA3_ROOT=${FA3_ROOT:-/opt/fa3}
if [ -f "$FA3_ARCHIVE" ]; then
  mkdir -p "$FA3_ROOT" && tar -xJf "$FA3_ARCHIVE" -C "$FA3_ROOT" && export PYTHONPATH=$PYTHONPATH:$FA3_ROOT
fi
W=${DEVICE_RESULTS:-/tmp/results}; mkdir -p "$W"  # logs gather here; each script packs them into one file under $OUT
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee -a "$W/gpu.txt"
pack() { tar czf "$OUT/results.tgz" -C "$W" . ; }
