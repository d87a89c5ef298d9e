/*
 * fencegate's gateway side, model-checked with Spin: retrying clients; two gateways, each a
 * process with a request handler per client and the writes it still owes the store
 * (PendingWrites), registered and heartbeating in the store; the store as the arbiter (one
 * transaction per decision, conditional writes, the in-flight lease by the database clock);
 * the upstream; the reconciler that asks the upstream what became of a key; an operator.
 * docs/protocol/model.md says it in words: what is modelled, each property and mutation,
 * the bounds, what is not proved.
 *
 * Faults, all nondeterministic and bounded: the store is unreachable for a while; a
 * statement commits after its caller gave up (or never); the database fails over; a gateway
 * crashes at any step; a gateway stops for any time at any step (SIGSTOP, a long pause: any
 * process may be slower than any lease, and its registry entry lapses meanwhile); a request
 * that left is held on its way for up to release_margin; the upstream's answer is lost or
 * the request never arrives; a client stops waiting at any moment and retries through
 * either gateway; time (the database clock) runs ahead of any process.
 *
 * Time is the database clock as an abstract tick, kept relative so that it runs for ever in
 * a finite state space: each key keeps key_t = locked_until + release_margin - now (ticks,
 * never below 0): the lease is live while key_t > MARGIN, the margin has passed at key_t = 0.
 * A gateway's clock runs at the database clock's rate (the 1% the code takes off the lease
 * covers its rate).
 *
 * Properties:
 *   1  the upstream executes each key at most once (on_unknown = "reject")  (assert)
 *   2  no request whose fence is below one already accepted for its entity is forwarded
 *      (needs two clients: -DNC=2)
 *   4  every answer a client saw for a key is the answer every later client sees for it
 *   5a a key answered 503 is eventually forwarded once the store is back
 *      (ltl forwarded_after_503, with -DLIVENESS: no gateway crash, weak fairness, and the
 *      timing assumption written at the Clock)
 *   6  no false 424: a key is answered 424 (outcome unknown) only when no gateway that is
 *      registered alive still owes it a write, and never by the gateway that owes it one
 *
 * Mutations (each a rule of the code removed; spec/check.sh runs them):
 *   -DON_UNKNOWN_RETRY        the route retries unknown outcomes          -> 1 fails
 *   -DASYNC_FAILOVER          the standby is asynchronous: a failover loses the tail that was
 *                             not replicated                              -> 1, 4 fail
 *   -DNO_BACKGROUND_RELEASE   a reservation whose statement outlived the caller's deadline
 *                             is left to its lease                        -> 5a fails
 *   -DNO_FENCE_CHECK          fencegate_step accepts any fence            -> 2 fails (-DNC=2)
 *   -DNO_SEND_DEADLINE        the gateway sends whenever it gets to it, however late -> 1
 *   -DUNBOUNDED_SEND          it checks its deadline right before sending, but the send is
 *                             not bounded by it (a pause after the check)  -> 1 fails
 *   -DDEADLINE_FROM_REPLY     the deadline counts from the reservation's answer, not from
 *                             before its round trip                        -> 1 fails
 *   -DRELEASE_NO_MARGIN       the release rule allows a release once the lease ended (no
 *                             release_margin for requests on their way)    -> 1 fails
 *   -DRECONCILE_ANY_TIME      the reconciler asks the upstream without the release rule and
 *                             acts on the answer later                     -> 1 fails
 *   -DRECONCILE_BLIND_WRITE   the reconciler's write is not conditional on the reservation it
 *                             asked about (same owner, attempt, state)     -> 1 fails
 *   -DPENDING_AS_UNKNOWN      fencegate_step answers unknown (424) for an in-flight key whose
 *                             owner is registered alive                    -> 6 fails
 *   -DNO_OWN_PENDING          the gateway answers 424 for a key it still owes a write itself
 *                                                                          -> 6 fails
 * An assumption taken away:
 *   -DOPERATOR_LOOKS_EARLY    the operator reads the upstream's log before the key is
 *                             releasable and resolves it once it is        -> 1 fails
 * The release rule's "owner alive" clause has no mutation: a registry entry may read lapsed
 * whenever its gateway could be stopped, so no property here rests on it (model.md).
 */

#ifndef NC
#define NC 1            /* clients; client c sends key c % NKEYS with fence c + 1 */
#endif
#ifndef NG
#define NG 2            /* gateways */
#endif
#ifndef NKEYS
#define NKEYS 1
#endif
#define NSLOT (NC * NG) /* a handler per client and gateway */
#ifndef GLEASE
#define GLEASE 2        /* the gateway's in-flight lease (lease_seconds), in ticks */
#endif
#define MARGIN 1        /* release_margin, in ticks: a request that left arrives within it */
#ifndef MAXFAULT
#define MAXFAULT 1      /* late statements, lost answers, requests lost or refused */
#endif
#ifndef MAXLATE
#define MAXLATE 1       /* 0: no statement outlives its caller (the others of MAXFAULT remain) */
#endif
#ifndef MAXDOWN
#define MAXDOWN 1       /* store outages (one of which may be a failover) */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1      /* gateway crashes */
#endif
#ifndef MAXSTOP
#define MAXSTOP 0       /* times a client stops waiting for an answer (0: no bound, -1: never
                         * while its gateway lives) */
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
#if !defined(ONLY) || ONLY == 6
#define P6(x) x
#else
#define P6(x) skip
#endif
/* ghosts that only the liveness property reads */
#ifdef LIVENESS
#define LIVE_GHOST(x) x
#else
#define LIVE_GHOST(x) skip
#endif

#define KEY(c) ((c) % NKEYS)
#define FENCE(c) ((c) + 1)
#define GW(slot) ((slot) % NG)
#define CLIENT(slot) ((slot) / NG)
#define NOBODY 255
/* A reservation's owner: the handler's slot and the generation of the request in it (a
 * handler takes its next request while the store still owes writes of earlier ones; the
 * code's owner, instance/n, names each request). */
#define ID(s, gen) ((s) + NSLOT * (gen))
#define SLOT_OF(o) ((o) % NSLOT)
#define ME ID(slot, gen[slot])
#define MYKEY KEY(CLIENT(slot))

mtype = { NOKEY, INFLIGHT, COMPLETED, UNKNOWN };      /* fencegate_idempotency_keys.state */
/* what a client receives (S503: store-unavailable or outcome-pending, both "retry") */
mtype = { ANSWER, REPLAY, S503, S409, S424, S412, S502, S504 };
/* a write a gateway owes the store */
mtype = { W_COMPLETE, W_RELEASE, W_UNKNOWN };

/* ---- the store (fencegate_step and the conditional writes of queries/gateway.sql) ---- */
mtype key_state[NKEYS];
byte key_owner[NKEYS];
byte key_t[NKEYS];              /* locked_until + release_margin - now(), in ticks, >= 0 */
byte key_answer[NKEYS];         /* the stored response */
byte last_fence = 0;            /* fencegate_fences, one entity */
bool down = false;              /* the store cannot be reached */
byte outages = 0;
/* fencegate_gateways (alive_until > now()) is read, not kept: a gateway's heartbeats may stop
 * arriving at any moment (it is stopped, its network or the store is away) and start again,
 * and a crashed gateway's entry lapses some time after the crash; so any reading of an entry
 * may find it alive or lapsed. A statement that reads it branches (read_registry). */

#define LIVE(k) (key_t[k] > MARGIN)                     /* locked_until > now() */
#define UNSETTLED(k) (key_state[k] == INFLIGHT || key_state[k] == UNKNOWN)

#ifdef ASYNC_FAILOVER
/* what the asynchronous standby has replayed so far */
mtype r_state[NKEYS];
byte r_owner[NKEYS];
byte r_t[NKEYS];
byte r_answer[NKEYS];
byte r_fence = 0;
#endif

/* ---- ghosts: the truth the properties speak of ----------------------------------------- */
byte executed[NKEYS];           /* how often the upstream ran each key (also its answer) */
byte seen[NKEYS];               /* the first answer a client saw for each key (0: none) */
byte g_fence = 0;               /* the highest fence ever accepted */
#ifdef LIVENESS
bool fwd[NKEYS];                /* the key was forwarded at least once */
bool got503[NC];
bool stale[NC];
#endif
byte tr[NSLOT];                 /* requests of each handler on their way to the upstream */
byte tr_aged[NSLOT];            /* ... of which a tick has passed since they left: they
                                 * arrive before the next tick (release_margin = 1 tick) */
byte abandoned[NSLOT];          /* ... whose handler stopped waiting for the answer */

byte faults = 0;
byte crashes = 0;
bool gw_dead[NG];

/* ---- the gateways' handlers and what they owe --------------------------------------------- */
chan hreq[NSLOT] = [1] of { bit };                      /* a client's request to a handler */
chan hrep[NSLOT] = [1] of { mtype, byte };              /* its answer: kind, stored answer */
chan uprep[NSLOT] = [1] of { bool, byte };              /* stored status?, answer */
chan late = [1] of { byte };                            /* a decide that outlived its caller */
bool busy[NSLOT];               /* the handler has a request */
byte waiting[NC];               /* the handler the client waits on (NOBODY: none) */
byte gen[NSLOT];                /* the generation of the handler's current request */
bool holding[NSLOT];            /* the current request holds its reservation */
byte dl[NSLOT];                 /* its send deadline, ticks left (the gateway's own clock) */
bool late_pending[NSLOT];       /* its abandoned decision still runs in the database */
/* PendingWrites: a write whose first try found the store away, kept trying in the background */
mtype owed_w[NSLOT];            /* 0: none */
byte owed_id[NSLOT];
byte owed_a[NSLOT];             /* the answer, for W_COMPLETE */
/* ... and the watch over an abandoned decision (release_abandoned), until the lease passed */
bool watching[NSLOT];
byte watch_id[NSLOT];
byte watch[NSLOT];              /* ticks left of the watch */

/* an abandoned decision still running, or a reservation of it still to release */
#define ABANDON_DUE(s) ((s) < NSLOT && watching[s] && (late_pending[s] || \
    (key_owner[KEY(CLIENT(s))] == watch_id[s] && key_state[KEY(CLIENT(s))] == INFLIGHT)))
#define OWED(s) ((s) < NSLOT && (owed_w[s] != 0 || ABANDON_DUE(s)))
#define any_owed (OWED(0) || OWED(1) || OWED(2) || OWED(3))
#define any_holding (holding[0] || (NSLOT > 1 && holding[1]) || (NSLOT > 2 && holding[2]) || (NSLOT > 3 && holding[3]))
#define TR_AGED(s) ((s) < NSLOT && tr_aged[s] > 0)
#define any_aged (TR_AGED(0) || TR_AGED(1) || TR_AGED(2) || TR_AGED(3))
/* a write the handler's gateway still owes for the reservation o */
#define JOB_FOR(s, o) ((owed_w[s] != 0 && owed_id[s] == (o)) || (watching[s] && watch_id[s] == (o)))

/* ---- the reconciler's claim (one key at a time) ---------------------------------------- */
byte rc_key = NOBODY;           /* the key it claimed */
bool rc_valid = false;          /* its row is still the reservation it claimed */
bool rc_ran = false;            /* what the upstream said: it ran the key (else: it did not) */

/* ---- the store's writes ----------------------------------------------------------------- */
/* Every write to a key's row: the reconciler's claim on it no longer holds (its conditional
 * write names owner, attempt and state: any write changes one of them). */
#define TOUCH(k) rc_valid = (rc_valid && rc_key != (k))
inline reserve(k, o) {
    key_state[k] = INFLIGHT; key_owner[k] = o; key_t[k] = GLEASE + MARGIN; TOUCH(k)
}
inline drop(k) { key_state[k] = NOKEY; key_owner[k] = NOBODY; key_t[k] = 0; TOUCH(k) }
inline settle(k, a) {
    key_state[k] = COMPLETED; key_owner[k] = NOBODY; key_answer[k] = a; key_t[k] = 0; TOUCH(k)
}
/* mark_unknown: locked_until becomes now(). The model's clock has a resolution of one tick
 * and the request this marks was sent before now(), possibly in the same tick: now() is
 * taken as the end of the current tick, the one reading that orders the two. */
inline mark_unknown(k) { key_state[k] = UNKNOWN; key_t[k] = MARGIN + 1; TOUCH(k) }
/* the gateway's conditional writes for reservation o: complete (owner, in_flight or
 * outcome_unknown), release (owner, in_flight), mark_unknown (owner, in_flight) */
inline write(w, k, o, a) {
    if
    :: w == W_COMPLETE && key_owner[k] == o && UNSETTLED(k) -> settle(k, a)
    :: w == W_RELEASE && key_owner[k] == o && key_state[k] == INFLIGHT -> drop(k)
    :: w == W_UNKNOWN && key_owner[k] == o && key_state[k] == INFLIGHT -> mark_unknown(k)
    :: else                                                     /* no longer this reservation */
    fi
}

/* reads the registry's entry of the owner of the in-flight key k into alive */
inline read_registry(k, alive) {
    if
    :: key_state[k] == INFLIGHT && key_owner[k] != NOBODY -> alive = true
    :: true -> alive = false
    fi
}

/* The release rule (fencegate_release_blocker) is NULL, given what the registry said of
 * the key's owner: not in flight with a live lease, not in flight with its owner alive,
 * and the lease ended release_margin ago. */
#ifdef RELEASE_NO_MARGIN
#define MARGIN_PASSED(k) (key_t[k] <= MARGIN)                   /* locked_until <= now() */
#else
#define MARGIN_PASSED(k) (key_t[k] == 0)            /* locked_until + release_margin <= now() */
#endif
#define OWNER_BLOCKS(k, alive) (key_state[k] == INFLIGHT && (alive))
#define RELEASABLE(k, alive) (UNSETTLED(k) && !(key_state[k] == INFLIGHT && LIVE(k)) && \
    !OWNER_BLOCKS(k, alive) && MARGIN_PASSED(k))

/* fencegate_step for one keyed, fenced request with owner o of client c. out: what happened;
 * alive: what it read of the owner's registry entry. */
inline decide(o, c, out, alive) {
    if
#ifdef NO_FENCE_CHECK
    :: false -> skip
#else
    :: FENCE(c) < last_fence -> out = S412                      /* stale: nothing stored */
#endif
    :: else ->
        if :: FENCE(c) > last_fence -> last_fence = FENCE(c) :: else fi;
        if
        :: key_state[KEY(c)] == NOKEY -> reserve(KEY(c), o); out = INFLIGHT
        :: key_state[KEY(c)] == COMPLETED -> out = REPLAY
        :: key_state[KEY(c)] == INFLIGHT && LIVE(KEY(c)) -> out = S409
        :: else ->                      /* outcome_unknown, or in flight with an expired lease */
#ifdef ON_UNKNOWN_RETRY
            reserve(KEY(c), o); out = INFLIGHT                  /* taken_over / retry_unknown */
#else
            read_registry(KEY(c), alive);
            if
#ifndef PENDING_AS_UNKNOWN
            /* pending: in flight, its owner alive: it still owes the key a write */
            :: key_state[KEY(c)] == INFLIGHT && alive -> out = S503
#endif
            :: else -> out = S424
            fi
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

/* Property 6: the reservation o of key k is still owed a write by a live gateway: its
 * request is still working on it, or a write of it is pending */
#define OWES(o, k) ((o) != NOBODY && key_state[k] == INFLIGHT && !gw_dead[GW(SLOT_OF(o))] && \
    (JOB_FOR(SLOT_OF(o), o) || (holding[SLOT_OF(o)] && ID(SLOT_OF(o), gen[SLOT_OF(o)]) == (o))))
/* the gateway g itself still owes key k a write: a pending write of one of its handlers */
#define JOB_KEY(s, k) ((s) < NSLOT && KEY(CLIENT(s)) == (k) && (owed_w[s] != 0 || watching[s]))
#define SELF_OWES(g, k) (JOB_KEY(g, k) || JOB_KEY((g) + NG, k))

/* ---- the handlers: engine.Engine.handle for one client at one gateway ------------------ */

/* the answer reaches the client only if it still waits for it (else the connection is gone) */
#define REPLY(kind, val) if :: waiting[CLIENT(slot)] == slot -> hrep[slot]!kind, val :: else fi
/* the request is done: the handler takes the next one */
#define DONE busy[slot] = false; holding[slot] = false; dl[slot] = 0; gen[slot] = 0; \
    out = 0; a = 0; stored = 0; b = 0

/* a write of the current request, then the answer; if the store is away, the answer, and the
 * write is kept trying in the background (one pending write per handler: a second waits) */
inline record(w, kind, val) {
    if
    :: atomic { !down -> write(w, MYKEY, ME, val); REPLY(kind, val); DONE }
    :: atomic { down && owed_w[slot] == 0 ->
                owed_w[slot] = w; owed_id[slot] = ME; owed_a[slot] = val; REPLY(kind, val); DONE }
    fi
}

/* the send deadline: checked right before the request leaves, and it bounds the send */
#ifdef NO_SEND_DEADLINE
#define CHECK_OK(slot) true
#define SEND_OK(slot) true
#elif defined(UNBOUNDED_SEND)
#define CHECK_OK(slot) (dl[slot] > 0)
#define SEND_OK(slot) true
#else
#define CHECK_OK(slot) (dl[slot] > 0)
#define SEND_OK(slot) (dl[slot] > 0)
#endif

/* a new request's generation: one that no pending write of this handler names */
inline new_gen() {
    gen[slot] = 0;
    do
    :: JOB_FOR(slot, ME) -> gen[slot]++
    :: else -> break
    od
}

proctype Handler(byte slot) {
    mtype out;
    bool stored, alive;
    byte a;
    bit b;
#ifdef UNBOUNDED_SEND
    bool checked;
#endif
    {
end:
    do
    :: hreq[slot]?b ->
        /* _decide: one transaction; the store may be down, or the statement may commit
         * after store_timeout, when the gateway has already answered 503. The send deadline
         * starts before the round trip: here at the commit, the latest it can start. */
        if
        :: atomic { !down -> new_gen(); decide(ME, CLIENT(slot), out, alive);
                    if
                    :: out == INFLIGHT -> accepted(CLIENT(slot)); holding[slot] = true;
#ifndef DEADLINE_FROM_REPLY
                       dl[slot] = GLEASE
#endif
                    :: out == S424 ->
#ifndef NO_OWN_PENDING
                       /* this gateway still owes the key a write: pending, not unknown */
                       if :: SELF_OWES(GW(slot), MYKEY) -> out = S503 :: else fi;
#endif
                       /* property 6: no false 424 */
                       P6(assert(out != S424 || !(OWES(key_owner[MYKEY], MYKEY) &&
                           (alive || GW(SLOT_OF(key_owner[MYKEY])) == GW(slot)))))
                    :: else
                    fi;
                    alive = false }
        :: atomic { down -> out = S503 }
        /* Engine._release_abandoned: whatever the decision reserved under this request's
         * own owner is released in the background (release_abandoned: owner, in_flight);
         * finding nothing is no proof (the statement may still commit), so it looks again
         * until the in-flight lease has passed */
#if MAXLATE > 0
        :: atomic { !down && faults < MAXFAULT && nfull(late) && !watching[slot] ->
                    new_gen(); faults++; late!ME; late_pending[slot] = true; out = S503;
#ifndef NO_BACKGROUND_RELEASE
                    watching[slot] = true; watch_id[slot] = ME; watch[slot] = GLEASE;
#endif
                    skip }
#endif
        fi;
        if
        :: out == INFLIGHT ->
#ifdef DEADLINE_FROM_REPLY
            dl[slot] = GLEASE;              /* the reservation's answer arrives, any time later */
#endif
            /* _execute: renew while connecting; right before the request leaves, check the
             * send deadline (the check and the send bounded by the deadline are one step:
             * a pause anywhere before it is a pause before the check) */
            do
#ifndef LIVENESS
            /* (under LIVENESS the request leaves within the first lease: see the Clock) */
            :: atomic { !down && key_owner[MYKEY] == ME && key_state[MYKEY] == INFLIGHT && LIVE(MYKEY) ->
                        key_t[MYKEY] = GLEASE + MARGIN; dl[slot] = GLEASE }  /* _renew_loop */
#endif
#ifdef UNBOUNDED_SEND
            :: atomic { !checked && CHECK_OK(slot) -> checked = true }  /* checked; may pause */
            :: atomic { checked && SEND_OK(slot) ->
#else
            :: atomic { SEND_OK(slot) ->
#endif
                        tr[slot]++; dl[slot] = 0; LIVE_GHOST(fwd[MYKEY] = true) }; break
            :: atomic {
#ifdef UNBOUNDED_SEND
                        !checked &&
#endif
                        !CHECK_OK(slot) -> out = S503 }; break  /* past the deadline: nothing sent */
            :: atomic { faults < MAXFAULT -> faults++; dl[slot] = 0; out = S502 }; break  /* refused: nothing sent */
            od;
#ifdef UNBOUNDED_SEND
            checked = false;
#endif
            if
            :: out == S502 || out == S503 -> record(W_RELEASE, out, 0)
            :: else ->
                do
                :: atomic { !down && key_owner[MYKEY] == ME && key_state[MYKEY] == INFLIGHT && LIVE(MYKEY) ->
                            key_t[MYKEY] = GLEASE + MARGIN }    /* _renew_loop */
                :: uprep[slot]?stored, a -> break
                :: atomic { empty(uprep[slot]) -> out = S504;           /* upstream timeout */
                            if :: tr[slot] > 0 -> abandoned[slot]++ :: else fi }; break
                od;
                if
                :: out == S504 -> record(W_UNKNOWN, S504, 0)            /* mark_unknown, 504 */
                /* a 5xx the route does not store: the upstream did not act; release */
                :: out != S504 && !stored -> record(W_RELEASE, S502, 0)
                :: out != S504 && stored -> record(W_COMPLETE, ANSWER, a)
                fi
            fi
        :: out == REPLAY -> atomic { REPLY(REPLAY, key_answer[MYKEY]); DONE }
        :: else -> atomic { REPLY(out, 0); DONE }              /* 503, 409, 412, 424 */
        fi
    od
    } unless { gw_dead[GW(slot)] }
}

/* The gateways' background: pending writes land once the store is back; the watch over an
 * abandoned decision releases what it reserved, or ends with the in-flight lease. A crash
 * takes a gateway's background with it (Crasher). */
inline background(s) {
    if
    :: atomic { owed_w[s] != 0 && !down ->
                write(owed_w[s], KEY(CLIENT(s)), owed_id[s], owed_a[s]);
                owed_w[s] = 0; owed_id[s] = 0; owed_a[s] = 0 }
    :: atomic { watching[s] && !down ->
                if
                :: key_owner[KEY(CLIENT(s))] == watch_id[s] && key_state[KEY(CLIENT(s))] == INFLIGHT ->
                    drop(KEY(CLIENT(s))); watching[s] = false
                :: else -> watching[s] = (watch[s] > 0)     /* nothing yet: looks again */
                fi;
                if :: !watching[s] -> watch_id[s] = 0; watch[s] = 0 :: else fi }
    fi
}
active proctype Background() {
end:
    do
    :: background(0)
#if NSLOT > 1
    :: background(1)
#endif
#if NSLOT > 2
    :: background(2)
#endif
#if NSLOT > 3
    :: background(3)
#endif
    od
}

/* A retrying client: sends its key (and fence) through either gateway until it gets an
 * answer, a replay or a final refusal (412, 424); stops waiting at any moment. Once it has
 * an answer it sends the request once more (a duplicate, or a retry after a lost answer):
 * property 4 is checked on what that one sees. */
#if MAXSTOP > 0
#define MAY_STOP (stops < MAXSTOP)
#define COUNT_STOP stops++
#elif MAXSTOP < 0
#define MAY_STOP false
#define COUNT_STOP skip
#else
#define MAY_STOP true
#define COUNT_STOP skip
#endif
inline respond() {
    if
    :: atomic { hrep[slot]?r, a -> waiting[c] = NOBODY;
        if
        :: r == ANSWER || r == REPLAY ->
            /* property 4: the answer it sees is the one every client saw before */
            P4(assert(seen[KEY(c)] == 0 || seen[KEY(c)] == a));
            seen[KEY(c)] = a;
            if :: again -> break :: else -> again = true fi
        :: r == S412 -> LIVE_GHOST(stale[c] = true); break
        :: r == S424 -> break
        :: r == S503 -> LIVE_GHOST(got503[c] = true)
        :: else                                                 /* 409, 502, 504 */
        fi;
        r = 0; a = 0; slot = 0 }
    :: atomic { empty(hrep[slot]) && (MAY_STOP || gw_dead[GW(slot)]) ->          /* stops waiting */
                COUNT_STOP; waiting[c] = NOBODY; slot = 0 }
    fi
}
proctype Client(byte c) {
    byte slot, a;
    mtype r;
    bool again = false;
#if MAXSTOP > 0
    byte stops = 0;
#endif
end:
    do
    :: atomic { !gw_dead[0] && !busy[c * NG] -> slot = c * NG; busy[slot] = true; waiting[c] = slot;
                hreq[slot]!0 };
       respond()
#if NG > 1
    :: atomic { !gw_dead[1] && !busy[c * NG + 1] -> slot = c * NG + 1; busy[slot] = true;
                waiting[c] = slot; hreq[slot]!0 };
       respond()
#endif
    od
}

/* Statements that outlived their caller: commit when the database gets to them, or are
 * aborted (a failover, statement_timeout). */
active proctype LateStatements() {
    byte o;
    mtype out;
    bool alive;
end:
    do
    :: atomic { late?o -> decide(o, CLIENT(SLOT_OF(o)), out, alive);
                if :: out == INFLIGHT -> accepted(CLIENT(SLOT_OF(o))) :: else fi;
                late_pending[SLOT_OF(o)] = false; o = 0; out = 0; alive = false }
    :: atomic { late?o -> late_pending[SLOT_OF(o)] = false; o = 0 }
    od
}

/* The database clock: every lease, release margin and local deadline moves towards its end,
 * and a request that left a tick ago has arrived (or was lost) before the next tick: it is
 * on its way for at most release_margin. Under LIVENESS, the timing assumption of property
 * 5a: a live gateway finishes with a reservation (forward, record, or release) within its
 * in-flight lease, which it renews; an outage is shorter than that lease; a write the
 * gateway owes the store lands within it once the store is back; a decision the gateway
 * gave up on ends (commits or rolls back: the store bounds it by the caller's deadline and
 * drops its connection) within that lease too. Without LIVENESS time is free: any process
 * may be slower than any lease. */
active proctype Clock() {
    byte k;
end:
    do
    :: atomic {
#ifdef LIVENESS
        !down && !any_owed && !any_holding &&
#endif
        !any_aged ->
        for (k : 0 .. NKEYS - 1) {
            if :: key_t[k] > 0 -> key_t[k]-- :: else fi
        };
        for (k : 0 .. NSLOT - 1) {
            if :: watch[k] > 0 -> watch[k]-- :: else fi;
            if :: dl[k] > 0 -> dl[k]-- :: else fi;
            tr_aged[k] = tr[k]
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
                do :: late?k -> late_pending[SLOT_OF(k)] = false :: empty(late) -> break od;
#ifdef ASYNC_FAILOVER
                for (k : 0 .. NKEYS - 1) {
                    key_state[k] = r_state[k]; key_owner[k] = r_owner[k];
                    key_t[k] = r_t[k]; key_answer[k] = r_answer[k]
                };
                last_fence = r_fence; rc_valid = false;
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
            r_t[k] = key_t[k]; r_answer[k] = key_answer[k]
        };
        r_fence = last_fence; k = 0 }
    od
}
#endif

#ifndef LIVENESS
/* The reconciler (every serve process runs one; one stands for them here): claims a key
 * whose outcome is unknown once the release rule allows releasing it, asks the upstream
 * (truthful: it ran the key, it did not, or it cannot tell), and writes on condition that
 * the row is still the reservation it claimed: ran -> completed with the upstream's answer,
 * did not run -> released, cannot tell -> left as it is (tried again later).
 *
 * Claim, question and write are one step here unless a mutation needs them apart
 * (RECONCILE_SPLIT): under the release rule nothing of the claimed reservation is on its
 * way and no one else may reserve the key, so the upstream's answer stays true, and a write
 * conditional on the unchanged row does what it would have done at the claim. The
 * operator's keys resolve (rule, upstream's log, write) is that same step, so the safety
 * runs leave the operator out; the mutations that need a second resolver put it in. */
#ifdef RECONCILE_ANY_TIME
#define CLAIMABLE(k, alive) UNSETTLED(k)
#define RECONCILE_SPLIT
#else
#define CLAIMABLE(k, alive) RELEASABLE(k, alive)
#endif
#ifdef RECONCILE_BLIND_WRITE
#define STILL_CLAIMED UNSETTLED(rc_key)
#define RECONCILE_SPLIT
#define OPERATOR
#else
#define STILL_CLAIMED rc_valid
#endif
#ifdef OPERATOR_LOOKS_EARLY
#define OPERATOR
#endif
inline claim(k) {
    read_registry(k, alive);
    if
    :: !down && CLAIMABLE(k, alive) ->
#ifdef RECONCILE_SPLIT
        rc_key = k; rc_valid = true; rc_ran = (executed[k] > 0)
#else
        if :: executed[k] > 0 -> settle(k, executed[k]) :: else -> drop(k) fi
#endif
    :: else                             /* refused by the rule, or the upstream cannot tell */
    fi;
    alive = false
}
active proctype Reconciler() {
    bool alive;
end:
    do
    :: atomic { rc_key == NOBODY && UNSETTLED(0) -> claim(0) }
#if NKEYS > 1
    :: atomic { rc_key == NOBODY && UNSETTLED(1) -> claim(1) }
#endif
#ifdef RECONCILE_SPLIT
    /* the conditional write, or lost (store down, process gone), or the row changed */
    :: atomic { rc_key != NOBODY && !down && STILL_CLAIMED && rc_ran ->
                settle(rc_key, executed[rc_key]); rc_key = NOBODY; rc_valid = false; rc_ran = false }
    :: atomic { rc_key != NOBODY && !down && STILL_CLAIMED && !rc_ran ->
                drop(rc_key); rc_key = NOBODY; rc_valid = false; rc_ran = false }
    :: atomic { rc_key != NOBODY -> rc_key = NOBODY; rc_valid = false; rc_ran = false }
#endif
    od
}

#ifdef OPERATOR
/* The operator (fencegate keys resolve): for a key whose outcome is unknown, records the
 * upstream's real answer, or releases the key if the upstream never ran it. The command
 * refuses while the release rule does (no --force). Assumption: the operator reads the
 * upstream once the key is releasable (keys show and the 424 say from when), and tells the
 * truth; -DOPERATOR_LOOKS_EARLY takes the first half away. */
#define UNKNOWN_KEY(k) (key_state[k] == UNKNOWN || (key_state[k] == INFLIGHT && !LIVE(k)))
inline resolve(k, ran) {
    read_registry(k, alive);
    if
    :: RELEASABLE(k, alive) -> if :: ran -> settle(k, executed[k]) :: else -> drop(k) fi;
       alive = false; break
    :: else                                                     /* refused: tries later */
    fi;
    alive = false
}
active proctype Operator() {
    byte k;
    bool alive;
#ifdef OPERATOR_LOOKS_EARLY
    bool ran;
#endif
    select (k : 0 .. NKEYS - 1);
#ifdef OPERATOR_LOOKS_EARLY
end_look:
    atomic { UNKNOWN_KEY(k) -> ran = (executed[k] > 0) };       /* reads the upstream's log */
#endif
end:
    do
#ifdef OPERATOR_LOOKS_EARLY
    :: atomic { !down && UNKNOWN_KEY(k) -> resolve(k, ran) }
#else
    :: atomic { !down && UNKNOWN_KEY(k) -> resolve(k, executed[k] > 0) }
#endif
    :: break                                                    /* never comes */
    od
}
#endif
#endif

/* A gateway process dies at any step, with every handler and pending write in it. */
active proctype Crasher() {
    byte g, s;
    if
    :: atomic { crashes < MAXCRASH -> select (g : 0 .. NG - 1); gw_dead[g] = true; crashes++;
                for (s : 0 .. NSLOT - 1) {
                    if
                    :: GW(s) == g -> owed_w[s] = 0; owed_id[s] = 0; owed_a[s] = 0;
                                     watching[s] = false; watch_id[s] = 0; watch[s] = 0;
                                     holding[s] = false; dl[s] = 0
                    :: else
                    fi
                };
                s = 0 }
    :: skip
    fi
}

/* The upstream executes what it receives. A request whose gateway stopped waiting still
 * runs; its answer goes nowhere (the connection is closed). */
inline arrive(s) {
    tr[s]--;
    if :: tr_aged[s] > 0 -> tr_aged[s]-- :: else fi;
    if
    :: abandoned[s] > 0 -> abandoned[s]--; answer = false
    :: else -> answer = true
    fi;
    if
    :: executed[KEY(CLIENT(s))]++;                              /* runs it, answers 2xx */
       P1(assert(executed[KEY(CLIENT(s))] <= 1));               /* property 1 */
       if
       :: answer -> uprep[s]!true, executed[KEY(CLIENT(s))]
       :: !answer -> skip
       :: answer && faults < MAXFAULT -> faults++               /* the answer is lost */
       fi
    :: answer -> uprep[s]!false, 0                              /* 5xx: did not act */
    :: !answer -> skip
    :: faults < MAXFAULT -> faults++                            /* the request never arrives */
    fi;
    answer = false
}
active proctype Upstream() {
    bool answer;
end:
    do
    :: atomic { tr[0] > 0 -> arrive(0) }
#if NSLOT > 1
    :: atomic { tr[1] > 0 -> arrive(1) }
#endif
#if NSLOT > 2
    :: atomic { tr[2] > 0 -> arrive(2) }
#endif
#if NSLOT > 3
    :: atomic { tr[3] > 0 -> arrive(3) }
#endif
    od
}

init {
    byte i;
    atomic {
        for (i : 0 .. NKEYS - 1) { key_state[i] = NOKEY; key_owner[i] = NOBODY };
#ifdef ASYNC_FAILOVER
        for (i : 0 .. NKEYS - 1) { r_state[i] = NOKEY; r_owner[i] = NOBODY };
#endif
        for (i : 0 .. NC - 1) { waiting[i] = NOBODY };
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
