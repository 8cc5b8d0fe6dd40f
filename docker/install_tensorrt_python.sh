#!/usr/bin/env bash
# Install the TensorRT Python API for the TensorRT libraries already in the NGC image.
#
# A TensorRT plan only loads in the TensorRT version that built it, and the image's libnvinfer is the one
# Triton and trtexec use, so the Python builder must bind to that very library: the version comes from the
# image (or $TENSORRT_VERSION), and the pip packages are the thin bindings only. `--no-deps` skips
# tensorrt-cuXX-libs, a second multi-GB copy of the libraries that the image already has.
set -euo pipefail

detect_tensorrt_version() {
    # NGC images install TensorRT as Debian packages (libnvinfer10, libnvinfer11, ...).
    dpkg-query -W -f='${Package} ${Version}\n' 'libnvinfer[0-9]*' 2>/dev/null \
        | awk '$1 ~ /^libnvinfer[0-9]+$/ { split($2, v, "-"); print v[1]; exit }'
}

version="${TENSORRT_VERSION:-$(detect_tensorrt_version)}"
if [[ -z "$version" ]]; then
    echo "install_tensorrt_python: no libnvinfer package in this image; pass --build-arg TENSORRT_VERSION=X.Y.Z.B" >&2
    exit 1
fi
cuda_major="${CUDA_VERSION%%.*}"
if [[ -z "$cuda_major" ]]; then
    echo "install_tensorrt_python: CUDA_VERSION is not set in this image, cannot pick tensorrt-cuXX" >&2
    exit 1
fi

# `==X.*` also matches NVIDIA's re-uploads such as 10.14.1.48.post1.
python3 -m pip install --no-deps "tensorrt-cu${cuda_major}==${version}.*" "tensorrt-cu${cuda_major}-bindings==${version}.*"
python3 -c "import tensorrt; print('tensorrt', tensorrt.__version__, 'for CUDA', '${cuda_major}')"
