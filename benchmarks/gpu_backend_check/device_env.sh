# Source on the GPU machine from the project root, after `source .device-pack/setup.sh`:
#   source benchmarks/gpu_backend_check/device_env.sh
# Builds the Python backend from the carried sources (once per machine) with CUDA support. That machine has
# no package registry and lacks three header packages: Debian's debs of them are carried in .device-src/debs
# and unpacked into /tmp/sysroot; libarchive to link against is the one inside the nvidia-pytriton bundle
# (the same library the server loads). Prepare the carry folder here with:
#   mkdir -p .device-src/debs && cp ../shared/third_party/*.tar.gz .device-src/ &&
#   (cd .device-src/debs && apt-get download rapidjson-dev libarchive-dev zlib1g-dev)
_sysroot=/tmp/sysroot
if [ ! -d $_sysroot/usr/include/rapidjson ]; then
  for deb in .device-src/debs/*.deb; do dpkg -x "$deb" $_sysroot; done
  mkdir -p $_sysroot/lib
  ln -sf /tmp/triton/nvidia_pytriton.libs/libarchive-*.so* $_sysroot/lib/libarchive.so
  [ -e /usr/lib/x86_64-linux-gnu/libz.so ] || ln -sf /usr/lib/x86_64-linux-gnu/libz.so.1 $_sysroot/lib/libz.so
fi
export CPATH=$_sysroot/usr/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$_sysroot/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
export CMAKE_PREFIX_PATH=$_sysroot/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m omni_triton.cli build python-backend --source .device-src --gpu ${BACKEND_BUILD_ARGS:-} \
  2>&1 | tee -a ${OUT:-/tmp}/python_backend_build.txt
