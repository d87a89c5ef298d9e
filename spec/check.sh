#!/usr/bin/env bash
# Model-check the protocol with Spin: every property of the real model must verify with no
# error, and every mutation (a rule of the code removed) must produce a counterexample trail
# that replays. Exits non-zero if any run disagrees. Usage: spec/check.sh [--keep DIR]
#   --keep DIR   leave each run's pan, output and trail in DIR/<run> (default: a temp dir,
#                removed at the end)
#   SPEC_ONLY=REGEX   runs only the runs whose name matches
#   SPEC_JOBS=N       runs at most N at once (default: 2, the cores this was sized for)
#   SPEC_SEARCH_MINUTES=N   the time limit of the bounded searches (default 1)
# Needs spin and a C compiler (Debian: apt-get install spin gcc).
#
# Expectations: ok = the search is exhaustive and finds no error; trail = at least one error,
# with a trail that replays to the violation; search = a bitstate search bounded by time
# (where exhaustive does not fit): no error in the states it reached, which the table gives,
# with the hash factor; it is not a proof. docs/protocol/model.md has the bounds and the
# coverage of each run.
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
jobs_max="${SPEC_JOBS:-2}"
minutes="${SPEC_SEARCH_MINUTES:-1}"
names=()

# one run, in its own directory; writes DIR/row (the table line) and DIR/result
run_one() {
  local name="$1" model="$2" expect="$3" defines="$4" cflags="$5" panflags="$6"
  local dir="$work/$name"
  mkdir -p "$dir"
  cp "$here/$model" "$dir/"
  # shellcheck disable=SC2086
  if ! (cd "$dir" && spin -a $defines "$model" >spin.out 2>&1 && gcc -O2 -w $cflags -o pan pan.c \
      >gcc.out 2>&1); then
    echo "fail" >"$dir/result"
    printf '%-40s %-6s %12s %12s %7s %9s  %s\n' "$name" "$expect" ? ? ? ? fail >"$dir/row"
    return 0
  fi
  local started ended
  started=$(date +%s.%N)
  # shellcheck disable=SC2086
  (cd "$dir" && ./pan $panflags >pan.out 2>&1) || true
  ended=$(date +%s.%N)
  local errors states transitions depth seconds result factor
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$dir/pan.out" | tail -n1)
  states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$dir/pan.out" | tail -n1)
  transitions=$(sed -n 's/^ *\([0-9.e+]*\) transitions.*/\1/p' "$dir/pan.out" | tail -n1)
  depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$dir/pan.out" | tail -n1)
  factor=$(sed -n 's/^hash factor: \([0-9.e+]*\).*/\1/p' "$dir/pan.out" | tail -n1)
  seconds=$(awk -v a="$started" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')
  result=fail
  case "$expect" in
    ok)
      if [ "${errors:-x}" = 0 ] && ! grep -qE 'max search depth too small|search not completed|Search not completed|out of memory' "$dir/pan.out"; then
        result=verified
      fi ;;
    search)
      if [ "${errors:-x}" = 0 ] && ! grep -qE 'out of memory' "$dir/pan.out"; then
        result="searched(h=${factor:-?})"
      fi ;;
    trail)
      if [ -n "$errors" ] && [ "$errors" -gt 0 ] && [ -f "$dir/$model.trail" ]; then
        # the trail must replay in the simulator to the violation it claims
        # shellcheck disable=SC2086
        (cd "$dir" && spin -t -p $defines "$model" >trail.txt 2>&1) || true
        if grep -qE 'assertion violated|START OF CYCLE' "$dir/trail.txt"; then
          result=caught
        fi
      fi ;;
  esac
  echo "$result" >"$dir/result"
  printf '%-40s %-6s %12s %12s %7s %9s  %s\n' "$name" "$expect" "${states:-?}" \
    "${transitions:-?}" "${depth:-?}" "$seconds" "$result" >"$dir/row"
}

# run NAME MODEL EXPECT "SPIN DEFINES" "GCC FLAGS" "PAN FLAGS": queued, at most SPEC_JOBS at once
run() {
  if [ -n "${SPEC_ONLY:-}" ] && ! [[ $1 =~ $SPEC_ONLY ]]; then
    return 0
  fi
  names+=("$1")
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do
    wait -n || true
  done
  run_one "$@" &
}

SAFE="-DSAFETY -DNOCLAIM -DCOLLAPSE"
LIVE="-DCOLLAPSE -DNFAIR=4"
SEARCH="-DSAFETY -DNOCLAIM -DBITSTATE"
TRAIL="-DSAFETY -DNOCLAIM"
# breadth-first: the shortest trail (docs/protocol/model.md tells some of them in words)
SHORT="-DSAFETY -DNOCLAIM -DBFS -DCOLLAPSE"
# The bounds (docs/protocol/model.md and README "The protocol, model-checked" have them in words).
LEASE_BOUNDS="-DNW=2 -DNSTAGES=1 -DNVAR=2 -DMAXATT=2 -DMAXFAULT=1 -DMAXCRASH=1"
# gateway: 2 gateways; one key (one client) or two (two clients, one entity); one outage (or
# failover), one gateway crash, one fault of the other kinds (a statement that outlives its
# caller, a lost answer, a lost or refused request); in-flight lease 2 ticks, release margin 1.
GW1="-DNC=1 -DNG=2 -DNKEYS=1 -DMAXFAULT=1 -DMAXDOWN=1"
GW2="-DNC=2 -DNG=2 -DNKEYS=2 -DMAXFAULT=1 -DMAXDOWN=1"
# a mutation's trail needs fewer faults: the fewest it needs, for short trails and fast runs
GW0="-DNC=1 -DNG=2 -DNKEYS=1 -DMAXFAULT=0 -DMAXDOWN=0 -DMAXCRASH=0"
GW0DOWN="-DNC=1 -DNG=2 -DNKEYS=1 -DMAXFAULT=0 -DMAXDOWN=1 -DMAXCRASH=0"
GW0LATE="-DNC=1 -DNG=2 -DNKEYS=1 -DMAXFAULT=1 -DMAXDOWN=0 -DMAXCRASH=0"

printf '%-40s %-6s %12s %12s %7s %9s  %s\n' run expect states transitions depth seconds result

# The real model. Gateway, exhaustive with one key: every fault at once, a client that stops
# waiting any number of times. Two keys: a bitstate search bounded by time.
# (the longest first: they are started in this order, SPEC_JOBS at a time)
run gateway-safety-p1-p4-p6               gateway.pml ok     "$GW1 -DMAXCRASH=1"                    "$SAFE" "-m200000 -w26"
run lease-liveness-p5b                    lease.pml   ok     "$LEASE_BOUNDS"                        "$LIVE" "-a -f -m1000000 -N reclaimed"
run lease-safety-p2-p3                    lease.pml   ok     "$LEASE_BOUNDS"                        "$SAFE" "-m1000000"
run gateway-2keys-p1-p2-p4-p6             gateway.pml search "$GW2 -DMAXCRASH=1 -DMAXSTOP=1"        "$SEARCH" "-m1000000 -w32 -Q$minutes"
run gateway-liveness-p5a                  gateway.pml ok     "$GW1 -DMAXCRASH=0 -DLIVENESS"         "$LIVE" "-a -f -m1000000 -N forwarded_after_503"

# Each rule removed: the property behind it must fail, with a trail.
run mutation-no-token-check-p3            lease.pml   trail  "$LEASE_BOUNDS -DNO_TOKEN_CHECK -DONLY=3"  "$TRAIL" "-m1000000"
run mutation-no-fence-check-p2            lease.pml   trail  "$LEASE_BOUNDS -DNO_FENCE_CHECK -DONLY=2"  "$TRAIL" "-m1000000"
run mutation-bare-timer-p5b               lease.pml   trail  "$LEASE_BOUNDS -DBARE_TIMER"               "$LIVE" "-a -f -m1000000 -N reclaimed"
run mutation-gw-no-fence-check-p2         gateway.pml trail  "$GW2 -DMAXCRASH=1 -DNO_FENCE_CHECK -DONLY=2" "$TRAIL" "-m20000"
run mutation-on-unknown-retry-p1          gateway.pml trail  "$GW0 -DON_UNKNOWN_RETRY -DONLY=1"       "$SHORT" "-m20000"
run mutation-async-failover-p1            gateway.pml trail  "$GW0DOWN -DASYNC_FAILOVER -DONLY=1"     "$SHORT" "-m20000"
run mutation-async-failover-p4            gateway.pml trail  "$GW0DOWN -DASYNC_FAILOVER -DONLY=4"     "$SHORT" "-m20000"
run mutation-no-bg-release-p5a            gateway.pml trail  "$GW1 -DMAXCRASH=0 -DLIVENESS -DNO_BACKGROUND_RELEASE" "$LIVE" "-a -f -m1000000 -N forwarded_after_503"
run mutation-no-send-deadline-p1          gateway.pml trail  "$GW0 -DNO_SEND_DEADLINE -DONLY=1"       "$SHORT" "-m20000"
run mutation-unbounded-send-p1            gateway.pml trail  "$GW0 -DUNBOUNDED_SEND -DONLY=1"         "$SHORT" "-m20000"
run mutation-deadline-from-reply-p1       gateway.pml trail  "$GW0 -DDEADLINE_FROM_REPLY -DONLY=1"    "$SHORT" "-m20000"
run mutation-release-no-margin-p1         gateway.pml trail  "$GW0 -DRELEASE_NO_MARGIN -DONLY=1"      "$SHORT" "-m20000"
run mutation-reconcile-any-time-p1        gateway.pml trail  "$GW0 -DRECONCILE_ANY_TIME -DONLY=1"     "$SHORT" "-m20000"
run mutation-reconcile-blind-write-p1     gateway.pml trail  "$GW0 -DRECONCILE_BLIND_WRITE -DONLY=1"  "$SHORT" "-m20000"
run mutation-pending-as-unknown-p6        gateway.pml trail  "$GW0 -DPENDING_AS_UNKNOWN -DONLY=6"     "$SHORT" "-m20000"
run mutation-no-own-pending-p6            gateway.pml trail  "$GW0LATE -DNO_OWN_PENDING -DONLY=6"   "$SHORT" "-m20000"
# An assumption taken away: the operator reads the upstream before the key is releasable.
run assumption-operator-looks-early-p1    gateway.pml trail  "$GW0 -DOPERATOR_LOOKS_EARLY -DONLY=1"   "$SHORT" "-m20000"
wait

failures=0
for name in "${names[@]}"; do
  cat "$work/$name/row"
  if [ "$(cat "$work/$name/result")" = fail ]; then
    failures=$((failures + 1))
  fi
done
for name in "${names[@]}"; do
  if [ "$(cat "$work/$name/result")" = fail ]; then
    echo "---- $name: pan said:" >&2
    cat "$work/$name/spin.out" "$work/$name/gcc.out" 2>/dev/null | head -n 10 >&2
    grep -vE '^Depth=' "$work/$name/pan.out" 2>/dev/null | head -n 30 >&2
  fi
done
if [ "$failures" -gt 0 ]; then
  echo "spec/check.sh: $failures run(s) disagreed with the expected result" >&2
  exit 1
fi
echo "spec/check.sh: every property verified (two keys: searched, bitstate, bounded by" \
  "${minutes} min), every mutation caught"
