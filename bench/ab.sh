#!/usr/bin/env bash
# A/B timing of two fa2cpu installs (PYTHONPATH dirs), alternating processes so drift hits both:
#   bench/ab.sh SITE_A SITE_B ROUNDS -- python-timing-snippet-args...
# Each round runs bench/ab_case.py once per site and prints its median; then the medians per site.
set -uo pipefail
A=$1; B=$2; R=$3; shift 4
HERE=$(cd "$(dirname "$0")" && pwd)
for i in $(seq "$R"); do
  for s in "$A" "$B"; do
    echo "$s $(cd /tmp && PYTHONPATH=$s python3 "$HERE/ab_case.py" "$@")"
  done
done
