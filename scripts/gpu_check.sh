#!/usr/bin/env bash
# The GPU check in one command; `--dry-run` runs every stage on the CPU at toy sizes. See scripts/gpu_check.py.
#   bash scripts/gpu_check.sh [--dry-run] [--stages memory,overhead,...] [--work DIR]
set -euo pipefail
exec python "$(dirname "$0")/gpu_check.py" "$@"
