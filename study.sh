#!/usr/bin/env bash
# The studies of dynpool, the paper's experiments as parts: study.py beside this script
# reads the flags, plans, prices and runs them (bash study.sh --help). It runs from any
# directory: the project's scripts are found beside it, paths are the user's.
command -v python >/dev/null || { echo "error: python is not on PATH" >&2; exit 1; }
exec python "$(dirname "$0")/study.py" "$@"
