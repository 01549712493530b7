#!/usr/bin/env bash
# Sourced after common.sh in a device call: unpack the cuDNN that this and earlier calls carried in parts
# (scripts/device/build_cudnn_carry.sh) and define `cudnn_use carried|image`, which puts it in place of the
# image's cuDNN 9.19, or the image's back, between the runs of one call (both are kept on the machine).
# Every copy of each library is replaced; the carried libraries the image lacks go beside each libcudnn.so.9.
# shellcheck source=scripts/device/carry_join.sh
source scripts/device/carry_join.sh && carry_join cudnn /tmp/cudnn.tar.xz || return 1
mkdir -p /tmp/cudnnx && tar xJf /tmp/cudnn.tar.xz -C /tmp/cudnnx || return 1
mapfile -t cudnn_image_files < <(find / -xdev -type f -name 'libcudnn*.so.9*' \
  -not -path '/tmp/*' -not -path '/opt/cudnn_image/*' 2>/dev/null)
[ ${#cudnn_image_files[@]} -gt 0 ] || { echo "use_carried_cudnn: no libcudnn*.so.9 on this machine" >&2; return 1; }
mkdir -p /opt/cudnn_image || return 1
cudnn_extras=()  # DIR/LIB for each carried library missing from a folder that holds the image's libcudnn.so.9
for f in "${cudnn_image_files[@]}"; do
  cp --parents --update=none "$f" /opt/cudnn_image || return 1
  case $(basename "$f") in libcudnn.so.9*) ;; *) continue ;; esac
  for lib in /tmp/cudnnx/*.so.9; do
    compgen -G "$(dirname "$f")/$(basename "$lib")*" >/dev/null || cudnn_extras+=("$(dirname "$f")/$(basename "$lib")")
  done
done
cudnn_use() {  # carried | image
  local f
  for f in "${cudnn_image_files[@]}"; do
    if [ "$1" = carried ]; then cp /tmp/cudnnx/"$(basename "$f" | sed 's/\.so\.9.*/.so.9/')" "$f"
    else cp /opt/cudnn_image"$f" "$f"; fi || return 1
  done
  for f in "${cudnn_extras[@]}"; do
    if [ "$1" = carried ]; then cp /tmp/cudnnx/"$(basename "$f")" "$f"; else rm -f "$f"; fi || return 1
  done
  python3 -c "from jax._src.lib import cuda_versions as c; import jax; jax.devices()
print('cuDNN seen by JAX:', c.cudnn_get_version())" | tee -a "$W/gpu.txt"
}
