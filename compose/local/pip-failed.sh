#!/usr/bin/env bash
# pip-failed.sh VENV: what to check when pip could not install the packages into VENV.
# The Makefile runs it after pip's own message; it exits 1 so that make stops.
source "$(dirname "$0")/env.sh"
df -h "$1" >&2 || true
die "pip could not install the packages (its message is above). They take about 7 GB in $1 (torch and its CUDA libraries), and pip needs as much again while it unpacks them: check the free space above."
