/*
 * fencegate's gateway side, model-checked with Spin: retrying clients, two gateways (each a
 * pool of request handlers), the store as the arbiter (one transaction per decision,
 * conditional writes, the in-flight lease by the database clock), the upstream, and an
 * operator who resolves keys whose outcome is unknown.
 *
 * Faults, all nondeterministic and bounded: the store is unreachable for a while; a
 * statement commits after its caller gave up (or never); the database fails over; a gateway
 * crashes at any step; the upstream's answer is lost or the request never arrives; a client
 * stops waiting at any moment and retries through either gateway; time (the database
 * clock) runs ahead of any process.
 *
 * Properties (README.md, "The protocol, model-checked", has the bounds and state counts):
 *   1  the upstream executes each key at most once (on_unknown = "reject")  (assert)
 *   2  no request whose fence is below one already accepted for its entity is forwarded
 *   4  every answer a client saw for a key is the answer every later client sees for it
 *   5a a key answered 503 is eventually forwarded once the store is back
 *      (ltl forwarded_after_503, with -DLIVENESS: no gateway crash, weak fairness, and the
 *      timing assumption written at the Clock)
 *
 * Mutations:
 *   -DON_UNKNOWN_RETRY      the route retries unknown outcomes       -> property 1 fails
 *   -DASYNC_FAILOVER        the standby is asynchronous: a failover loses the tail that was
 *                           not replicated                           -> property 1/4 fail
 *   -DNO_BACKGROUND_RELEASE a reservation whose statement outlived the caller's deadline
 *                           is left to its lease                     -> property 5a fails
 *   -DNO_FENCE_CHECK        fencegate_step accepts any fence (property 2; needs two
 *                           clients with two keys, -DNC=2 -DNKEYS=2, a larger state space:
 *                           spec/check.sh catches this mutation in lease.pml instead)
 */

#ifndef NC
#define NC 2            /* clients; client c sends key c % NKEYS with fence c + 1 */
#endif
#ifndef NG
#define NG 2            /* gateways */
#endif
#ifndef NKEYS
#define NKEYS 1
#endif
#define NSLOT (NC * NG) /* a handler per client and gateway: its owner name */
#ifndef GLEASE
#define GLEASE 2        /* the gateway's in-flight lease (lease_seconds), in ticks */
#endif
#ifndef MAXFAULT
#define MAXFAULT 1      /* late statements, lost answers, requests lost to the upstream */
#endif
#ifndef MAXDOWN
#define MAXDOWN 1       /* store outages (one of which may be a failover) */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1      /* gateway crashes */
#endif

/* -DONLY=n keeps the assertion of property n alone (a mutation's trail then shows it) */
#if !defined(ONLY) || ONLY == 1
#define P1(x) x
#else
#define P1(x) skip
#endif
#if !defined(ONLY) || ONLY == 2
#define P2(x) x
#else
#define P2(x) skip
#endif
#if !defined(ONLY) || ONLY == 4
#define P4(x) x
#else
#define P4(x) skip
#endif

#define KEY(c) ((c) % NKEYS)
#define FENCE(c) ((c) + 1)
#define GW(slot) ((slot) % NG)
#define CLIENT(slot) ((slot) / NG)
#define NOBODY 255

mtype = { NOKEY, INFLIGHT, COMPLETED, UNKNOWN };      /* fencegate_idempotency_keys.state */
/* what a client receives */
mtype = { ANSWER, REPLAY, S503, S409, S424, S412, S502, S504 };

/* ---- the store (fencegate_step and the conditional writes of queries/gateway.sql) ---- */
mtype key_state[NKEYS];
byte key_owner[NKEYS];
byte key_lease[NKEYS];          /* locked_until - now(), in ticks; live iff > 0 */
byte key_answer[NKEYS];         /* the stored response */
byte last_fence = 0;            /* fencegate_fences, one entity */
bool down = false;              /* the store cannot be reached */
byte outages = 0;

#ifdef ASYNC_FAILOVER
/* what the asynchronous standby has replayed so far */
mtype r_state[NKEYS];
byte r_owner[NKEYS];
byte r_lease[NKEYS];
byte r_answer[NKEYS];
byte r_fence = 0;
#endif

/* ---- ghosts: the truth the properties speak of ----------------------------------------- */
byte executed[NKEYS];           /* how often the upstream ran each key */
byte up_answer[NKEYS];          /* the upstream's last answer for each key */
byte seen[NKEYS];               /* the first answer a client saw for each key (0: none) */
byte g_fence = 0;               /* the highest fence ever accepted */
bool fwd[NKEYS];                /* the key was forwarded at least once */
bool got503[NC];
bool stale[NC];
byte in_up[NKEYS];              /* requests for the key on their way to the upstream */
byte in_up_slot[NSLOT];         /* ... from each handler */
byte abandoned[NSLOT];          /* ... whose handler stopped waiting for the answer */
bool window[NSLOT];             /* between reserving and handing the request to the upstream */

byte faults = 0;
byte crashes = 0;
bool gw_dead[NG];
bool busy[NSLOT];

chan hreq[NSLOT] = [1] of { bit };                      /* a client's request to a handler */
chan hrep[NSLOT] = [1] of { mtype, byte };              /* its answer: kind, stored answer */
chan up = [2] of { byte, byte };                        /* to the upstream: key, handler */
chan uprep[NSLOT] = [1] of { bool, byte };              /* stored status?, answer */
chan late = [1] of { byte };                            /* a decide that outlived its caller */
bool late_pending[NSLOT];
bool owed[NSLOT];               /* a write the store owes the handler (PendingWrites) */
bool holding[NSLOT];            /* the handler holds a reservation it is working on */
bool watching[NSLOT];           /* a background release of an abandoned decision */
byte watch[NSLOT];              /* ticks left of its watch (the in-flight lease) */
/* an abandoned decision still running, or a reservation of it still to release */
#define ABANDON_DUE(s) ((s) < NSLOT && watching[s] && (late_pending[s] || \
    (key_owner[KEY(CLIENT(s))] == (s) && key_state[KEY(CLIENT(s))] == INFLIGHT)))
#define OWED(s) ((s) < NSLOT && (owed[s] || ABANDON_DUE(s)))
#define any_owed (OWED(0) || OWED(1) || OWED(2) || OWED(3))
#define any_holding (holding[0] || (NSLOT > 1 && holding[1]) || (NSLOT > 2 && holding[2]) || (NSLOT > 3 && holding[3]))

/* ---- store statements ------------------------------------------------------------------ */

/* fencegate_step for one keyed, fenced request from handler slot. out: what happened. */
inline decide(slot, c, out) {
    if
#ifdef NO_FENCE_CHECK
    :: false -> skip
#else
    :: FENCE(c) < last_fence -> out = S412                      /* stale: nothing stored */
#endif
    :: else ->
        if :: FENCE(c) > last_fence -> last_fence = FENCE(c) :: else fi;
        if
        :: key_state[KEY(c)] == NOKEY ->                        /* reserved */
            key_state[KEY(c)] = INFLIGHT; key_owner[KEY(c)] = slot; key_lease[KEY(c)] = GLEASE;
            out = INFLIGHT
        :: key_state[KEY(c)] == COMPLETED -> out = REPLAY
        :: key_state[KEY(c)] == INFLIGHT && key_lease[KEY(c)] > 0 -> out = S409
        :: else ->                      /* outcome_unknown, or in flight with an expired lease */
#ifdef ON_UNKNOWN_RETRY
            key_state[KEY(c)] = INFLIGHT; key_owner[KEY(c)] = slot; key_lease[KEY(c)] = GLEASE;
            out = INFLIGHT                                      /* taken_over / retry_unknown */
#else
            out = S424
#endif
        fi
    fi
}

/* A decision that reserves is a fence accepted and a request about to be forwarded. */
inline accepted(c) {
    /* property 2: never below a fence accepted before */
    P2(assert(FENCE(c) >= g_fence));
    if :: FENCE(c) > g_fence -> g_fence = FENCE(c) :: else fi
}

#define HOLDS(slot, k) (key_owner[k] == (slot) && (key_state[k] == INFLIGHT || key_state[k] == UNKNOWN))

/* ---- the handlers: engine.Engine.handle for one client at one gateway ------------------ */
proctype Handler(byte slot) {
    byte c = CLIENT(slot);
    byte k = KEY(c);
    mtype out;
    bool stored, gave_up;
    byte a;
    bit b;
    {
end:
    do
    :: hreq[slot]?b ->
        /* _decide: one transaction; the store may be down, or the statement may commit
         * after store_timeout, when the gateway has already answered 503 */
        if
        :: atomic { !down -> decide(slot, c, out);
                    if :: out == INFLIGHT -> accepted(c); window[slot] = true; holding[slot] = true :: else fi }
        :: atomic { down -> out = S503 }
        :: atomic { !down && faults < MAXFAULT && nfull(late) ->
                    faults++; late!slot; late_pending[slot] = true; gave_up = true; out = S503;
                    watching[slot] = true; watch[slot] = GLEASE }
        fi;
        if
        :: out == S503 ->
#ifdef NO_BACKGROUND_RELEASE
            watching[slot] = false;
#endif
            hrep[slot]!S503, 0;
#ifndef NO_BACKGROUND_RELEASE
            /* Engine._release_abandoned: whatever the decision reserved under this request's
             * own owner is released in the background (release_abandoned: owner, in_flight),
             * retried while the store is down; finding nothing is no proof (the statement may
             * still commit), so it looks again until the in-flight lease has passed */
            if
            :: gave_up ->
                do
                :: atomic { !down ->
                        if
                        :: key_owner[k] == slot && key_state[k] == INFLIGHT ->
                            key_state[k] = NOKEY; key_owner[k] = NOBODY; key_lease[k] = 0;
                            gave_up = false
                        :: else -> gave_up = (watch[slot] > 0)
                        fi;
                        watching[slot] = gave_up };
                   if :: !gave_up -> break :: else fi
                od
            :: else
            fi
#endif
        :: out == INFLIGHT ->
            /* _execute: forward while holding the in-flight lease */
            if
            :: atomic { nfull(up) -> up!k, slot; in_up[k]++; in_up_slot[slot]++; window[slot] = false; fwd[k] = true }
            :: atomic { faults < MAXFAULT -> faults++; window[slot] = false; out = S502 }   /* refused: nothing sent */
            fi;
            if
            :: out == S502 ->
                /* release (owner, in_flight); kept trying in the background if the store is down */
                owed[slot] = true;
                do
                :: atomic { !down -> owed[slot] = false;
                        if
                        :: key_owner[k] == slot && key_state[k] == INFLIGHT ->
                            key_state[k] = NOKEY; key_owner[k] = NOBODY; key_lease[k] = 0
                        :: else
                        fi };
                   break
                od;
                hrep[slot]!S502, 0
            :: else ->
                do
                :: atomic { !down && key_owner[k] == slot && key_state[k] == INFLIGHT && key_lease[k] > 0 ->
                        key_lease[k] = GLEASE }                 /* _renew_loop */
                :: uprep[slot]?stored, a -> break
                :: atomic { empty(uprep[slot]) -> out = S504;           /* upstream timeout */
                            if :: in_up_slot[slot] > 0 -> abandoned[slot]++ :: else fi }; break
                od;
                if
                :: out == S504 ->
                    /* mark_unknown (owner, in_flight), 504 */
                    owed[slot] = true;
                    do
                    :: atomic { !down -> owed[slot] = false;
                            if
                            :: key_owner[k] == slot && key_state[k] == INFLIGHT -> key_state[k] = UNKNOWN
                            :: else
                            fi };
                       break
                    od;
                    hrep[slot]!S504, 0
                :: out != S504 && !stored ->
                    /* a 5xx the route does not store: the upstream did not act; release */
                    owed[slot] = true;
                    do
                    :: atomic { !down -> owed[slot] = false;
                            if
                            :: key_owner[k] == slot && key_state[k] == INFLIGHT ->
                                key_state[k] = NOKEY; key_owner[k] = NOBODY; key_lease[k] = 0
                            :: else
                            fi };
                       break
                    od;
                    hrep[slot]!S502, 0
                :: out != S504 && stored ->
                    /* complete (owner, in_flight or outcome_unknown). The client gets the
                     * answer whether or not the store takes it now; an answer the store
                     * could not take is kept trying in the background (PendingWrites). */
                    if
                    :: atomic { !down ->
                            if :: HOLDS(slot, k) -> key_state[k] = COMPLETED; key_answer[k] = a; key_lease[k] = 0
                            :: else fi };
                       hrep[slot]!ANSWER, a
                    :: down ->
                       hrep[slot]!ANSWER, a;
                       owed[slot] = true;
                       do
                       :: atomic { !down -> owed[slot] = false;
                               if :: HOLDS(slot, k) -> key_state[k] = COMPLETED; key_answer[k] = a; key_lease[k] = 0
                               :: else fi };
                          break
                       od
                    fi
                fi
            fi
        :: out == REPLAY -> atomic { hrep[slot]!REPLAY, key_answer[k] }
        :: else -> hrep[slot]!out, 0                            /* 409, 412, 424 */
        fi;
        atomic { busy[slot] = false; holding[slot] = false; out = 0; a = 0; stored = 0; b = 0; gave_up = false }
    od
    } unless { gw_dead[GW(slot)] }
}

/* A retrying client: sends its key (and fence) through either gateway until it gets an
 * answer, a replay or a final refusal (412, 424); stops waiting at any moment. Once it has
 * an answer it sends the request once more (a duplicate, or a retry after a lost answer):
 * property 4 is checked on what that one sees. */
inline respond() {
    if
    :: hrep[slot]?r, a
    :: r = 0
    fi;
    atomic {
    if
    :: r == ANSWER || r == REPLAY ->
        P4(assert(seen[KEY(c)] == 0 || seen[KEY(c)] == a));
        seen[KEY(c)] = a;
        if :: again -> break :: else -> again = true fi
    :: r == S412 -> stale[c] = true; break
    :: r == S424 -> break
    :: r == S503 -> got503[c] = true
    :: else
    fi;
    r = 0; a = 0; slot = 0
    }
}
proctype Client(byte c) {
    byte slot, a;
    mtype r;
    bool again = false;
end:
    do
    :: atomic { !gw_dead[0] && !busy[c * NG] -> slot = c * NG; busy[slot] = true;
                do :: hrep[slot]?_, _ :: empty(hrep[slot]) -> break od; hreq[slot]!0 };
       respond()
    :: atomic { !gw_dead[1] && !busy[c * NG + 1] -> slot = c * NG + 1; busy[slot] = true;
                do :: hrep[slot]?_, _ :: empty(hrep[slot]) -> break od; hreq[slot]!0 };
       respond()
    od
}

/* Statements that outlived their caller: commit when the database gets to them, or are
 * aborted (a failover, statement_timeout). */
active proctype LateStatements() {
    byte slot;
    mtype out;
end:
    do
    :: atomic { late?slot -> decide(slot, CLIENT(slot), out);
                if :: out == INFLIGHT -> accepted(CLIENT(slot)) :: else fi;
                late_pending[slot] = false; slot = 0; out = 0 }
    :: atomic { late?slot -> late_pending[slot] = false; slot = 0 }
    od
}

/* The database clock: every in-flight lease moves towards its end. Under LIVENESS, the
 * timing assumption of property 5a: a live gateway finishes with a reservation (forward,
 * record, or release) within its in-flight lease, which it renews; an outage is shorter
 * than that lease; a write the gateway owes the store lands within it once the store is
 * back; a decision the gateway gave up on ends (commits or rolls back: the store bounds it
 * by the caller's deadline and drops its connection) within that lease too. Without
 * LIVENESS time is free: any process may be slower than any lease. */
active proctype Clock() {
    byte k;
end:
    do
    :: atomic {
#ifdef LIVENESS
        !down && !any_owed && !any_holding ->
#endif
        for (k : 0 .. NKEYS - 1) {
            if :: key_lease[k] > 0 -> key_lease[k]-- :: else fi
        };
        for (k : 0 .. NSLOT - 1) {
            if :: watch[k] > 0 -> watch[k]-- :: else fi
        };
        k = 0 }
    od
}

/* The store goes away and comes back; one of the outages may be a failover. A failover
 * aborts statements still running; with synchronous replication it loses nothing that
 * committed, with asynchronous replication the standby's state is all there is. */
active proctype Store() {
    byte k;
end:
    do
    :: atomic { !down && outages < MAXDOWN -> outages++; down = true }
    :: atomic { !down && outages < MAXDOWN -> outages++; down = true;
                do :: late?k -> late_pending[k] = false :: empty(late) -> break od;
#ifdef ASYNC_FAILOVER
                for (k : 0 .. NKEYS - 1) {
                    key_state[k] = r_state[k]; key_owner[k] = r_owner[k];
                    key_lease[k] = r_lease[k]; key_answer[k] = r_answer[k]
                };
                last_fence = r_fence;
#endif
                k = 0 }
    :: atomic { down -> down = false }
    od
}

#ifdef ASYNC_FAILOVER
/* The asynchronous standby catches up whenever it does. */
active proctype Replication() {
    byte k;
end:
    do
    :: atomic {
        for (k : 0 .. NKEYS - 1) {
            r_state[k] = key_state[k]; r_owner[k] = key_owner[k];
            r_lease[k] = key_lease[k]; r_answer[k] = key_answer[k]
        };
        r_fence = last_fence; k = 0 }
    od
}
#endif

/* The operator (fencegate keys resolve): for a key whose outcome is unknown, records the
 * upstream's real answer, or releases the key if the upstream never ran it. Assumption:
 * they act only once no request for the key can still reach the upstream (none on its way,
 * no live gateway between reserving it and sending it). */
#define WIN(s, k) ((s) < NSLOT && KEY(CLIENT(s)) == (k) && window[s] && !gw_dead[GW(s)])
#define NO_WINDOW(k) (!WIN(0, k) && !WIN(1, k) && !WIN(2, k) && !WIN(3, k))
#define UNKNOWN_KEY(k) (key_state[k] == UNKNOWN || (key_state[k] == INFLIGHT && key_lease[k] == 0))
active proctype Operator() {
    byte k;
#ifndef LIVENESS
    select (k : 0 .. NKEYS - 1);
    if
    :: atomic { !down && UNKNOWN_KEY(k) && in_up[k] == 0 && NO_WINDOW(k) ->
        if
        :: executed[k] > 0 -> key_state[k] = COMPLETED; key_answer[k] = up_answer[k]
        :: else -> key_state[k] = NOKEY
        fi;
        key_owner[k] = NOBODY; key_lease[k] = 0 }
    :: skip                                                     /* never comes */
    fi
#endif
}

/* A gateway process dies at any step, with every handler and background write in it. */
active proctype Crasher() {
    byte g;
    if
    :: atomic { crashes < MAXCRASH -> select (g : 0 .. NG - 1); gw_dead[g] = true; crashes++ }
    :: skip
    fi
}

/* The upstream executes what it receives. A request whose gateway stopped waiting still
 * runs; its answer goes nowhere (the connection is closed). */
active proctype Upstream() {
    byte k, slot;
    bool answer;
end:
    do
    :: atomic { up?k, slot -> in_up[k]--; in_up_slot[slot]--;
        if
        :: abandoned[slot] > 0 -> abandoned[slot]--; answer = false
        :: else -> answer = true
        fi;
        if
        :: executed[k]++;                                       /* runs it, answers 2xx */
           P1(assert(executed[k] <= 1));                        /* property 1 */
           up_answer[k] = executed[k];
           if
           :: answer -> uprep[slot]!true, executed[k]
           :: !answer -> skip
           :: answer && faults < MAXFAULT -> faults++           /* the answer is lost */
           fi
        :: answer -> uprep[slot]!false, 0                       /* 5xx: did not act */
        :: !answer -> skip
        :: faults < MAXFAULT -> faults++                        /* the request never arrives */
        fi;
        k = 0; slot = 0; answer = false }
    od
}

init {
    byte i;
    atomic {
        for (i : 0 .. NKEYS - 1) { key_state[i] = NOKEY; key_owner[i] = NOBODY };
#ifdef ASYNC_FAILOVER
        for (i : 0 .. NKEYS - 1) { r_state[i] = NOKEY; r_owner[i] = NOBODY };
#endif
        for (i : 0 .. NSLOT - 1) { run Handler(i) };
        for (i : 0 .. NC - 1) { run Client(i) };
        i = 0
    }
}

#ifdef LIVENESS
/* 5a: a client answered 503 sees its key forwarded (or its fence refused) eventually. */
ltl forwarded_after_503 {
    [] ((got503[0] -> <> (fwd[KEY(0)] || stale[0])) && (got503[NC - 1] -> <> (fwd[KEY(NC - 1)] || stale[NC - 1])))
}
#endif
