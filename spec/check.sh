#!/usr/bin/env bash
# Model-check the protocol with Spin: every property of the real model must verify with no
# error, and every mutation (a rule of the code removed) must produce a counterexample trail.
# Exits non-zero on the first run that disagrees. Usage: spec/check.sh [--keep DIR]
#   --keep DIR   leave each run's pan, output and trail in DIR/<run> (default: a temp dir,
#                removed at the end)
#   SPEC_ONLY=REGEX in the environment runs only the runs whose name matches
# Needs spin and a C compiler (Debian: apt-get install spin gcc).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
keep=""
if [ "${1:-}" = "--keep" ]; then
  keep="${2:?--keep needs a directory}"
fi
for tool in spin gcc; do
  command -v "$tool" >/dev/null || { echo "spec/check.sh: $tool is not installed" >&2; exit 2; }
done
if [ -n "$keep" ]; then
  mkdir -p "$keep"; work="$(cd "$keep" && pwd)"
else
  work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
fi

failures=0
printf '%-34s %-6s %12s %12s %7s %9s  %s\n' run expect states transitions depth seconds result

# run NAME MODEL EXPECT "SPIN DEFINES" "GCC FLAGS" "PAN FLAGS"
# EXPECT: ok (errors: 0, search complete) or trail (errors > 0, a replayable trail)
run() {
  local name="$1" model="$2" expect="$3" defines="$4" cflags="$5" panflags="$6"
  if [ -n "${SPEC_ONLY:-}" ] && ! [[ $name =~ $SPEC_ONLY ]]; then
    return 0
  fi
  local dir="$work/$name"
  mkdir -p "$dir"
  cp "$here/$model" "$dir/"
  # shellcheck disable=SC2086
  (cd "$dir" && spin -a $defines "$model" >spin.out 2>&1 && gcc -O2 -w $cflags -o pan pan.c)
  local started ended
  started=$(date +%s.%N)
  # shellcheck disable=SC2086
  (cd "$dir" && ./pan $panflags >pan.out 2>&1) || true
  ended=$(date +%s.%N)
  local errors states transitions depth seconds result
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$dir/pan.out" | tail -n1)
  states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$dir/pan.out" | tail -n1)
  transitions=$(sed -n 's/^ *\([0-9.e+]*\) transitions.*/\1/p' "$dir/pan.out" | tail -n1)
  depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$dir/pan.out" | tail -n1)
  seconds=$(awk -v a="$started" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')
  result=fail
  if [ "$expect" = ok ]; then
    if [ "${errors:-x}" = 0 ] && ! grep -qE 'max search depth too small|search not completed|out of memory' "$dir/pan.out"; then
      result=verified
    fi
  else
    if [ -n "$errors" ] && [ "$errors" -gt 0 ] && [ -f "$dir/$model.trail" ]; then
      # the trail must replay in the simulator to the violation it claims
      # shellcheck disable=SC2086
      (cd "$dir" && spin -t -p $defines "$model" >trail.txt 2>&1) || true
      if grep -qE 'assertion violated|START OF CYCLE' "$dir/trail.txt"; then
        result=caught
      fi
    fi
  fi
  printf '%-34s %-6s %12s %12s %7s %9s  %s\n' "$name" "$expect" "${states:-?}" \
    "${transitions:-?}" "${depth:-?}" "$seconds" "$result"
  if [ "$result" = fail ]; then
    failures=$((failures + 1))
    echo "---- $name: pan said:" >&2
    grep -vE '^Depth=' "$dir/pan.out" | head -n 30 >&2
  fi
}

SAFE="-DSAFETY -DNOCLAIM -DCOLLAPSE"
LIVE="-DCOLLAPSE -DNFAIR=4"
# The bounds (README "The protocol, model-checked" has them in words).
LEASE_BOUNDS="-DNW=2 -DNSTAGES=1 -DNVAR=2 -DMAXATT=2 -DMAXFAULT=1 -DMAXCRASH=1"
GW_BOUNDS="-DNC=1 -DNG=2 -DNKEYS=1 -DMAXFAULT=1 -DMAXDOWN=1"

# The real model: properties 2 and 3 (and 1 in the workers' gateway), 5b; 1, 4 and 5a.
run lease-safety-p2-p3           lease.pml   ok    "$LEASE_BOUNDS"                          "$SAFE" "-m1000000"
run lease-liveness-p5b           lease.pml   ok    "$LEASE_BOUNDS"                          "$LIVE" "-a -f -m1000000 -N reclaimed"
run gateway-safety-p1-p4         gateway.pml ok    "$GW_BOUNDS -DMAXCRASH=1"                "$SAFE" "-m1000000"
run gateway-liveness-p5a         gateway.pml ok    "$GW_BOUNDS -DMAXCRASH=0 -DLIVENESS"     "$LIVE" "-a -f -m1000000 -N forwarded_after_503"

# Each rule removed: the property behind it must fail, with a trail.
run mutation-no-token-check-p3   lease.pml   trail "$LEASE_BOUNDS -DNO_TOKEN_CHECK -DONLY=3"  "-DSAFETY -DNOCLAIM" "-m1000000"
run mutation-no-fence-check-p2   lease.pml   trail "$LEASE_BOUNDS -DNO_FENCE_CHECK -DONLY=2"  "-DSAFETY -DNOCLAIM" "-m1000000"
run mutation-on-unknown-retry-p1 gateway.pml trail "$GW_BOUNDS -DMAXCRASH=1 -DON_UNKNOWN_RETRY -DONLY=1" "-DSAFETY -DNOCLAIM" "-m1000000"
run mutation-async-failover-p1   gateway.pml trail "$GW_BOUNDS -DMAXCRASH=1 -DASYNC_FAILOVER -DONLY=1" "-DSAFETY -DNOCLAIM" "-m1000000"
run mutation-async-failover-p4   gateway.pml trail "$GW_BOUNDS -DMAXCRASH=1 -DASYNC_FAILOVER -DONLY=4" "-DSAFETY -DNOCLAIM" "-m1000000"
run mutation-no-bg-release-p5a   gateway.pml trail "$GW_BOUNDS -DMAXCRASH=0 -DLIVENESS -DNO_BACKGROUND_RELEASE" "$LIVE" "-a -f -m1000000 -N forwarded_after_503"
run mutation-bare-timer-p5b      lease.pml   trail "$LEASE_BOUNDS -DBARE_TIMER"              "$LIVE" "-a -f -m1000000 -N reclaimed"

if [ "$failures" -gt 0 ]; then
  echo "spec/check.sh: $failures run(s) disagreed with the expected result" >&2
  exit 1
fi
echo "spec/check.sh: every property verified, every mutation caught"
