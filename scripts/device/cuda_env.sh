# Sourced (bash) by scripts/gpu_check.sh, scripts/device/nccl_check.sh and scripts/device/h200.sh:
# finds what CubeCL's CUDA runtime and the NCCL engine load at run time on a GPU machine with no
# Rust toolchain (CUDA 13 toolkit, PyTorch's nvidia-* wheels), in a folder that outlives the
# callers' steps.
#
#   cuda_env_setup LIBDIR LOG   CUDA_PATH (headers NVRTC compiles against) and an NVRTC of the
#                               same toolkit, first on LD_LIBRARY_PATH; returns 3 if either is
#                               missing.
#   nccl_env_setup LIBDIR LOG   libnccl.so in LIBDIR (a link to NCCL's libnccl.so.2: cudarc looks
#                               for libnccl.so, and PyTorch's wheel ships only the .so.2), LIBDIR
#                               first on LD_LIBRARY_PATH; returns 3 if NCCL is missing.
#
# Both append what they found to LOG. LIBDIR is the caller's and is not deleted here: processes
# started later (h200.sh's --nccl training step) load from it.

# `python3`'s nvidia.* wheel folders named include/, lib/ or lib64/, one per line.
nvidia_wheel_dirs() {
    command -v python3 >/dev/null 2>&1 || return 0
    python3 - <<'PY' 2>/dev/null
import os, site, sys
roots = set()
for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    d = os.path.join(p, "nvidia")
    if os.path.isdir(d):
        roots.add(os.path.realpath(d))
for r in sorted(roots):
    for dirpath, dirnames, _ in os.walk(r, followlinks=True):
        if os.path.basename(dirpath) in ("include", "lib", "lib64"):
            print(dirpath)
            dirnames[:] = []
PY
}

# The first file named like PATTERN directly in one of the folders (links followed: a toolkit's
# lib64 is often a link, and `find` without -L does not enter a linked starting folder).
first_in() {
    local pattern="$1" d hit
    shift
    for d in "$@"; do
        [ -d "$d" ] || continue
        hit="$(find -L "$d" -maxdepth 1 -name "$pattern" \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
        [ -n "$hit" ] && { echo "$hit"; return 0; }
    done
    return 1
}

# "major.minor" of the NVRTC library $1 (nvrtcVersion), or "?".
nvrtc_version() {
    python3 - "$1" <<'PY' 2>/dev/null || echo "?"
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
major, minor = ctypes.c_int(), ctypes.c_int()
assert lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
print(f"{major.value}.{minor.value}")
PY
}

cuda_env_setup() {
    local libdir="$1" log="$2" d cuda_dir="" nvrtc="" wheels
    mkdir -p "$libdir"
    wheels="$(nvidia_wheel_dirs)"
    # Headers: a toolkit first (its NVRTC matches its headers), else the wheels' merged.
    for d in "${CUDA_PATH:-}" /usr/local/cuda /opt/cuda /usr/local/cuda-13* /usr/local/cuda-12*; do
        if [ -n "$d" ] && [ -f "$d/include/cuda_fp16.h" ]; then
            cuda_dir="$d"
            break
        fi
    done
    if [ -n "$cuda_dir" ]; then
        nvrtc="$(first_in 'libnvrtc.so*' "$cuda_dir/lib64" "$cuda_dir/lib" \
            "$cuda_dir/targets/x86_64-linux/lib")"
    fi
    if [ -z "$nvrtc" ]; then
        # No toolkit NVRTC: the wheels' headers and NVRTC together (one CUDA release).
        cuda_dir="$libdir/cuda"
        mkdir -p "$cuda_dir/include"
        for d in $wheels; do
            case "$d" in
                */include)
                    for f in "$d"/*; do
                        [ -e "$cuda_dir/include/$(basename "$f")" ] || ln -s "$f" "$cuda_dir/include/"
                    done
                    ;;
            esac
        done
        # shellcheck disable=SC2086
        nvrtc="$(first_in 'libnvrtc.so*' $(printf '%s\n' $wheels | grep -E '/lib(64)?$'))"
        [ -f "$cuda_dir/include/cuda_fp16.h" ] || cuda_dir=""
    fi
    if [ -z "$cuda_dir" ] || [ -z "$nvrtc" ]; then
        echo "CUDA headers (include/cuda_fp16.h) or libnvrtc not found: install the CUDA toolkit or set CUDA_PATH (headers: ${cuda_dir:-none}, nvrtc: ${nvrtc:-none})" | tee -a "$log"
        return 3
    fi
    export CUDA_PATH="$cuda_dir"
    # cudarc opens libnvrtc.so (or .so.<major>): a link beside the others covers a lone .so.13.
    ln -sf "$(readlink -f "$nvrtc")" "$libdir/libnvrtc.so"
    export LD_LIBRARY_PATH="$libdir:$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    {
        echo "CUDA_PATH=$CUDA_PATH"
        echo "libnvrtc: $nvrtc (nvrtcVersion $(nvrtc_version "$nvrtc"))"
        echo "libcuda: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so' || echo 'not in the ldconfig cache')"
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    } | tee -a "$log"
}

nccl_env_setup() {
    local libdir="$1" log="$2" so="" d sites
    mkdir -p "$libdir"
    if command -v python3 >/dev/null 2>&1; then
        so="$(python3 - <<'PY' 2>/dev/null
import glob, os
import nvidia.nccl as m
for d in list(getattr(m, "__path__", [])) or [os.path.dirname(m.__file__)]:
    for c in sorted(glob.glob(os.path.join(d, "lib", "libnccl.so.2*"))):
        print(c)
        raise SystemExit
PY
)"
        if [ -z "$so" ]; then
            sites="$(python3 -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")]))' 2>/dev/null)"
            for d in $sites; do
                [ -d "$d" ] || continue
                so="$(find -L "$d" -name 'libnccl.so.2*' \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
                [ -n "$so" ] && break
            done
        fi
    fi
    [ -z "$so" ] && so="$(first_in 'libnccl.so.2*' /usr/lib/x86_64-linux-gnu /usr/local/lib /usr/lib64 \
        /usr/local/cuda/lib64)"
    if [ -z "$so" ]; then
        echo "libnccl.so.2 not found (python3's nvidia.nccl, site-packages, system library folders)" | tee -a "$log"
        return 3
    fi
    ln -sf "$(readlink -f "$so")" "$libdir/libnccl.so"
    ln -sf "$(readlink -f "$so")" "$libdir/libnccl.so.2"
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$libdir:"*) ;;
        *) export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    echo "libnccl: $so, linked as $libdir/libnccl.so" | tee -a "$log"
}
