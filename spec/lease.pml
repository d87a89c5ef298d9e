/*
 * fencegate's worker side, model-checked with Spin: the lease queue (the database as the
 * arbiter), workers with a heartbeat on its own process, the fenced client, stages, the
 * conditional commit, and a gateway that checks fences and keys in front of an upstream.
 *
 * Properties (README.md, "The protocol, model-checked", has the bounds and state counts):
 *   2  no request whose fence is below one already accepted for its entity is forwarded
 *      to the upstream                                         (assert in gateway_step)
 *   3  no job result (a stage or the job's own) is committed except by the owner of the
 *      live lease with the current token                       (assert in db_commit)
 *   5b a job whose worker died is eventually reclaimed         (ltl reclaimed)
 * and, as a sanity check of the gateway used here, 1 (each key executed at most once).
 *
 * Time is the database clock as an abstract tick, kept relative: the job's lease and each
 * worker's local deadline are "ticks left", so time runs for ever in a finite state space.
 * A worker's local clock advances at the database's rate (no drift); a pause or a slow
 * network is a process that does not move while ticks happen, which Spin explores freely.
 *
 * Mutations (each must produce a counterexample; spec/check.sh runs them):
 *   -DNO_TOKEN_CHECK   extend / complete / fail / stage commit match owner and live lease
 *                      but not the fencing token                  -> property 3 fails
 *   -DNO_FENCE_CHECK   the gateway accepts any fence                  -> property 2 fails
 *   -DBARE_TIMER       the heartbeat renews on a timer, even for an executor that is
 *                      gone                                           -> property 5b fails
 */

#ifndef NW
#define NW 2          /* workers */
#endif
#ifndef NSTAGES
#define NSTAGES 1     /* stages of the job, each one tool call then a stage commit */
#endif
#ifndef NVAR
#define NVAR 2        /* calls a tool may choose between at a stage (an agent's choice) */
#endif
#define NKEYS (NSTAGES * NVAR)
#ifndef LEASE
#define LEASE 2       /* lease_seconds, in ticks */
#endif
#define MARGIN 0      /* ownership margin: a call starts only with more than this left */
#ifndef MAXATT
#define MAXATT 2      /* max_attempts */
#endif
#ifndef MAXFAULT
#define MAXFAULT 2    /* statements lost or late, replies lost, requests duplicated */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1    /* executors that die (MAXCRASH < NW, so someone is left) */
#endif

#define NONE 255

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
#if !defined(ONLY) || ONLY == 3
#define P3(x) x
#else
#define P3(x) skip
#endif

mtype = { QUEUED, RUNNING, SUCCEEDED, FAILED };         /* fencegate_jobs.state */
mtype = { OWNED, UNKNOWN, LOST };                       /* execution.py Ownership */
mtype = { CLAIM, EXTEND, COMPLETE, FAIL, STAGE };       /* statements */
mtype = { OK, STALE, TIMEOUT };                         /* what a tool call returns */

/* ---- the database (sql/postgres/queries/lease.sql; one job) ---------------------------- */
mtype job_state = QUEUED;
byte job_owner = NONE;
byte job_token = 0;
byte job_lease = 0;           /* lease_until - now(), in ticks; the lease is live iff > 0 */
byte job_attempt = 0;
byte token_seq = 0;           /* fencegate_fencing_tokens */
bool stage_done[NSTAGES];     /* fencegate_job_stages */

/* ---- the gateway's tables (fencegate_fences, fencegate_idempotency_keys) -------------- */
byte last_fence = 0;          /* the one entity: job:<id> */
bool key_done[NKEYS];

/* ---- ghosts: the truth the properties speak of, never read by the protocol ------------ */
byte g_token = 0;             /* the token of the latest grant */
byte g_owner = NONE;          /* ... and its owner */
byte g_fence = 0;             /* the highest fence accepted so far */
byte executed[NKEYS];         /* how often the upstream ran each key */

/* ---- the workers, as each knows itself (execution.py) -------------------------------- */
mtype own[NW];
byte conf[NW];                /* ticks left to the local deadline (sent_at + lease) */
byte my_token[NW];
bool running[NW];             /* Execution.running: registered with the heartbeat */
bool crashed[NW];             /* the executor died (a process crash takes its heartbeat too) */
byte faults = 0;
byte crashes = 0;

/* requests to the gateway that were delayed: key, fence (the entity is the job's) */
chan gw = [NW] of { byte, byte };
/* statements that commit after their caller gave up: op, worker, token, argument */
chan late = [2] of { mtype, byte, byte, byte };

#define live_holder(w, tok) \
    (job_state == RUNNING && job_owner == (w) && job_lease > 0 && TOKEN_MATCH(tok))
#ifdef NO_TOKEN_CHECK
#define TOKEN_MATCH(tok) true
#else
#define TOKEN_MATCH(tok) (job_token == (tok))
#endif

/* lease_claim_*: fail an expired job with no attempt left, else grant a lease with the
 * next token. ok: a lease was granted to w. */
inline db_claim(w, ok) {
    ok = false;
    if
    :: job_state == RUNNING && job_lease == 0 && job_attempt >= MAXATT ->
        job_state = FAILED                              /* the "exhausted" CTE */
    :: (job_state == QUEUED) || (job_state == RUNNING && job_lease == 0 && job_attempt < MAXATT) ->
        token_seq++;
        job_state = RUNNING; job_owner = w; job_token = token_seq;
        job_lease = LEASE; job_attempt++;
        g_token = token_seq; g_owner = w;
        ok = true
    :: else -> skip
    fi
}

/* property 3, checked where a result is written */
#define OWNER_OF_LIVE_LEASE(w, tok) P3(assert((tok) == g_token && (w) == g_owner && job_lease > 0))

/* lease_extend_many / lease_commit_stage_many / lease_complete_many / lease_fail_many:
 * all conditional on the holder; ok: a row matched. */
inline db_commit(op, w, tok, arg, ok) {
    ok = live_holder(w, tok);
    if
    :: ok && op == EXTEND -> job_lease = LEASE
    :: ok && op == STAGE -> OWNER_OF_LIVE_LEASE(w, tok); stage_done[arg] = true
    :: ok && op == COMPLETE -> OWNER_OF_LIVE_LEASE(w, tok); job_state = SUCCEEDED; job_lease = 0
    :: ok && op == FAIL ->
        job_lease = 0;
        if   /* policy.fails_for_good */
        :: job_attempt >= MAXATT -> job_state = FAILED
        :: else -> job_state = QUEUED; job_owner = NONE
        fi
    :: else -> skip
    fi
}

inline db_run(op, w, tok, arg, ok) {
    if
    :: op == CLAIM -> db_claim(w, ok)
    :: else -> db_commit(op, w, tok, arg, ok)
    fi
}

/* One statement from worker w, sent, committed and answered in one step (ok says whether
 * a row matched); or the caller hears nothing (err): the statement waits in `late`, where it
 * may commit at once (its answer lost), later (after its caller gave up), or never. */
inline db_call(op, w, tok, arg, ok, err) {
    if
    :: db_run(op, w, tok, arg, ok); err = false
    :: faults < MAXFAULT && nfull(late) -> faults++; late!op, w, tok, arg; err = true; ok = false
    fi
}

/* Statements that outlived their caller commit whenever the database gets to them. */
active proctype LateStatements() {
    mtype op; byte w, tok, arg; bool ok;
end:
    do
    :: atomic { late?op, w, tok, arg -> db_run(op, w, tok, arg, ok); ok = false }
    :: atomic { late?op, w, tok, arg -> op = 0; w = 0; tok = 0; arg = 0 }   /* aborted */
    od
}

/* The database clock. Every "ticks left" counter moves down together. */
active proctype Clock() {
    byte i;
end:
    do
    :: atomic {
        if :: job_lease > 0 -> job_lease-- :: else fi;
        i = 0;
        do
        :: i < NW ->
            if :: conf[i] > 0 -> conf[i]-- :: else fi;
            i++
        :: else -> i = 0; break
        od
    }
    od
}

/* The gateway in front of the upstream (gateway/engine.py, fencegate_step): the fence first
 * (step 3), then the key (step 4); a new key is forwarded, executed and recorded. The
 * gateway's own faults are the subject of gateway.pml; here its answer can be lost and a
 * request delivered twice. */
inline gateway_step(k, f, res) {
#ifdef NO_FENCE_CHECK
    if :: true ->
#else
    if :: f >= last_fence ->
#endif
        if :: f > last_fence -> last_fence = f :: else fi;
        if
        :: !key_done[k] ->
            /* reaches the upstream: property 2 (and 1) */
            P2(assert(f >= g_fence));
            executed[k]++;
            P1(assert(executed[k] <= 1));
            key_done[k] = true
        :: else -> skip                                 /* replay */
        fi;
        if :: f > g_fence -> g_fence = f :: else fi;
        res = OK
    :: else -> res = STALE                              /* 412 stale-fence */
    fi
}

/* Requests that were delayed on the way: the gateway takes them whenever they arrive (the
 * caller stopped waiting long ago), or they are lost. */
active proctype Gateway() {
    byte k, f;
    mtype res;
end:
    do
    :: atomic { gw?k, f -> gateway_step(k, f, res); k = 0; f = 0; res = 0 }
    :: atomic { gw?k, f -> k = 0; f = 0 }
    od
}

/* The heartbeat controller's loop for worker w's execution (heartbeat.py _keep): renews
 * while the execution runs and its executor is alive; zero rows -> lost, cancel; no answer
 * -> ownership unknown, and lost once the local deadline passes the margin. */
proctype Heartbeat(byte w) {
    bool ok, err;
    byte tok;
end:
    do
#ifdef BARE_TIMER
    :: running[w] && own[w] != LOST ->
#else
    :: running[w] && !crashed[w] && own[w] != LOST ->   /* Execution.running, abandoned() */
#endif
        atomic {
            tok = my_token[w];
            db_call(EXTEND, w, tok, 0, ok, err);
            if
            :: err ->
                if :: own[w] == OWNED -> own[w] = UNKNOWN :: else fi;
                if :: conf[w] <= MARGIN -> own[w] = LOST :: else fi   /* ownership_unknown_past_margin */
            :: !err && ok -> own[w] = OWNED; conf[w] = LEASE           /* heartbeat_ok */
            :: !err && !ok -> own[w] = LOST                            /* zero rows: heartbeat_lost */
            fi;
            ok = false; err = false; tok = 0
        }
    od
}

/* A worker (worker.py): claim, run the tool through the fenced client stage by stage,
 * settle with a conditional complete or fail. The executor may die at any step. */
proctype Worker(byte w) {
    bool ok, err, tool_err;
    byte s, k;
    mtype res;
    {
end:
    do
    :: atomic {
        (job_state == QUEUED || (job_state == RUNNING && job_lease == 0)) ->
        db_call(CLAIM, w, 0, 0, ok, err);
        if                                              /* _launch: Execution(lease, sent_at) */
        :: ok -> my_token[w] = job_token; conf[w] = LEASE; own[w] = OWNED; running[w] = true
        :: else
        fi;
        tool_err = false; s = 0; err = false
        };
        if
        :: ok ->
            ok = false;
            do
            :: own[w] == LOST -> break                  /* cancelled by the controller */
            :: own[w] != LOST && s == NSTAGES -> break
            :: atomic { own[w] != LOST && s < NSTAGES && stage_done[s] -> s++ }  /* skipped */
            :: atomic { own[w] != LOST && s < NSTAGES && !stage_done[s] ->
                /* FencedClient.request -> start_request -> job.guard() */
                if
                :: own[w] == OWNED && conf[w] > MARGIN -> skip
                :: else -> tool_err = true; break       /* OwnershipUnknown / OwnershipLost */
                fi;
                if
                :: k = s * NVAR
#if NVAR > 1
                :: k = s * NVAR + 1
#endif
                fi;
                /* the request with key, fence = token, entity = the job */
                if
                :: gateway_step(k, my_token[w], res)   /* answered */
                :: faults < MAXFAULT && nfull(gw) ->    /* delayed: the tool times out */
                    faults++; gw!k, my_token[w]; res = TIMEOUT
                :: faults < MAXFAULT && nfull(gw) ->    /* delivered twice, answered once */
                    faults++; gw!k, my_token[w]; gateway_step(k, my_token[w], res)
                fi;
                k = 0;
                if
                :: res != OK -> tool_err = true; res = 0; break   /* the tool raises */
                :: else -> res = 0
                fi
               };
               atomic {
                db_call(STAGE, w, my_token[w], s, ok, err);   /* JobContext.stage commit */
                if
                :: ok -> s++; ok = false
                :: else -> tool_err = true; err = false; break
                fi
               }
            od;
            running[w] = false;                         /* unregister: before _settle */
            if
            :: own[w] == LOST -> skip                   /* result_rejected, nothing written */
            :: else ->
                /* _conditional: retried while the local deadline has not passed */
                do
                :: atomic { tool_err -> db_call(FAIL, w, my_token[w], 0, ok, err);
                    if :: !err -> break :: err && conf[w] == 0 -> break :: else fi }
                :: atomic { !tool_err -> db_call(COMPLETE, w, my_token[w], 0, ok, err);
                    if :: !err -> break :: err && conf[w] == 0 -> break :: else fi }
                od
            fi;
            atomic { own[w] = LOST; ok = false; err = false; tool_err = false; s = 0 }
        :: else -> skip
        fi
    od
    } unless { crashed[w] }
}

/* Executors die at any step (at most MAXCRASH of them, never all). */
active proctype Crasher() {
    byte i;
end:
    do
    :: atomic { crashes < MAXCRASH -> select(i : 0 .. NW - 1); crashes++; crashed[i] = true };
       break
    od
}

init {
    byte i;
    atomic {
        i = 0;
        do
        :: i < NW -> own[i] = LOST; run Worker(i); run Heartbeat(i); i++
        :: else -> break
        od
    }
}

/* 5b: a job held by a dead executor is eventually taken from it: reclaimed by another
 * worker, or failed by the claim that finds its attempts exhausted. */
#define orphaned (job_state == RUNNING && job_owner != NONE && crashed[job_owner])
ltl reclaimed { [] (orphaned -> <> !orphaned) }
