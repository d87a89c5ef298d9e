-- The fencegate 1.0 schema of PostgreSQL: its tables, types, sequences and indexes, as every
-- migration up to 1.0 left them. Functions (and the triggers that call them) are not here: each
-- has one file in functions/, which `fencegate migrate` applies after the versioned migrations
-- whenever its text changes. A database made before 1.0 is brought here by legacy/ instead.

-- Name: fencegate_decide_step; Type: TYPE

CREATE TYPE fencegate_decide_step AS (
	tenant text,
	key text,
	fingerprint text,
	entity text,
	fence bigint,
	owner text,
	lease_seconds double precision,
	ttl_seconds double precision,
	retry_unknown boolean,
	request_id text,
	method text,
	target text,
	request_body bytea,
	reconcile boolean
);

-- Name: fencegate_fence; Type: DOMAIN

CREATE DOMAIN fencegate_fence AS bigint
	CONSTRAINT fencegate_fence_check CHECK ((VALUE >= 0));

-- Name: fencegate_key_state; Type: TYPE

CREATE TYPE fencegate_key_state AS ENUM (
    'in_flight',
    'completed',
    'outcome_unknown'
);

-- Name: fencegate_record_step; Type: TYPE

CREATE TYPE fencegate_record_step AS (
	tenant text,
	key text,
	owner text,
	attempt integer,
	status integer,
	headers text,
	body bytea,
	sha256 text,
	too_large boolean,
	request_id text
);

-- Name: fencegate_audit; Type: TABLE

CREATE TABLE fencegate_audit (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    actor text NOT NULL,
    action text NOT NULL,
    tenant text,
    subject text NOT NULL,
    reason text,
    before jsonb,
    after jsonb
);

-- Name: fencegate_audit_id_seq; Type: SEQUENCE

ALTER TABLE fencegate_audit ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME fencegate_audit_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: fencegate_decisions; Type: TABLE

CREATE TABLE fencegate_decisions (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    tenant text NOT NULL,
    entity text,
    key text,
    fence bigint,
    decision text NOT NULL,
    attempt integer,
    owner text,
    request_id text,
    method text,
    target text,
    upstream_status integer,
    expires_at timestamp with time zone NOT NULL
);

-- Name: fencegate_decisions_id_seq; Type: SEQUENCE

ALTER TABLE fencegate_decisions ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME fencegate_decisions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: fencegate_fences; Type: TABLE

CREATE TABLE fencegate_fences (
    tenant text NOT NULL,
    entity text NOT NULL,
    last_accepted fencegate_fence NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL
)
WITH (fillfactor='70');

-- Name: fencegate_fencing_tokens; Type: SEQUENCE

CREATE SEQUENCE fencegate_fencing_tokens
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

-- Name: fencegate_gateways; Type: TABLE

CREATE TABLE fencegate_gateways (
    instance text NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    alive_until timestamp with time zone NOT NULL
);

-- Name: fencegate_idempotency_keys; Type: TABLE

CREATE TABLE fencegate_idempotency_keys (
    tenant text NOT NULL,
    key text NOT NULL,
    fingerprint text NOT NULL,
    state fencegate_key_state NOT NULL,
    owner text,
    locked_until timestamp with time zone,
    attempt integer DEFAULT 1 NOT NULL,
    entity text,
    fence bigint,
    response_status integer,
    response_headers jsonb,
    response_body bytea,
    response_sha256 text,
    body_too_large boolean DEFAULT false NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    completed_at timestamp with time zone,
    expires_at timestamp with time zone NOT NULL,
    reserved_at timestamp with time zone,
    method text,
    target text,
    request_body bytea,
    unknown_reason text,
    resolution text,
    reconcile_after timestamp with time zone,
    reconcile_tries integer DEFAULT 0 NOT NULL,
    reconcile_note text
)
WITH (fillfactor='20');

-- Name: fencegate_job_attempts; Type: TABLE

CREATE TABLE fencegate_job_attempts (
    fencing_token bigint NOT NULL,
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    owner_id text NOT NULL,
    claimed_at timestamp with time zone DEFAULT now() NOT NULL,
    ended_at timestamp with time zone,
    outcome text,
    error jsonb,
    CONSTRAINT fencegate_job_attempts_check CHECK (((ended_at IS NULL) = (outcome IS NULL))),
    CONSTRAINT fencegate_job_attempts_outcome_check CHECK ((outcome = ANY (ARRAY['succeeded'::text, 'failed'::text, 'retry_scheduled'::text, 'released'::text, 'cancelled'::text, 'lease_expired'::text])))
)
WITH (fillfactor='80');

-- Name: fencegate_job_stages; Type: TABLE

CREATE TABLE fencegate_job_stages (
    job_id bigint NOT NULL,
    name text NOT NULL,
    idempotency_key text NOT NULL,
    result jsonb,
    fencing_token bigint NOT NULL,
    committed_at timestamp with time zone DEFAULT now() NOT NULL
);

-- Name: fencegate_jobs; Type: TABLE

CREATE TABLE fencegate_jobs (
    id bigint NOT NULL,
    kind text NOT NULL,
    state text DEFAULT 'queued'::text NOT NULL,
    owner_id text,
    lease_until timestamp with time zone,
    fencing_token bigint,
    heartbeat_at timestamp with time zone,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer NOT NULL,
    run_after timestamp with time zone DEFAULT now() NOT NULL,
    idempotency_key text NOT NULL,
    payload jsonb DEFAULT 'null'::jsonb NOT NULL,
    result jsonb,
    error jsonb,
    lease_seconds double precision NOT NULL,
    heartbeat_seconds double precision NOT NULL,
    jitter_seconds double precision NOT NULL,
    stage_timeout_seconds double precision,
    tool_timeout_seconds double precision,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    concurrency_key text,
    model text,
    CONSTRAINT fencegate_jobs_check CHECK (((state <> 'running'::text) OR ((owner_id IS NOT NULL) AND (lease_until IS NOT NULL) AND (fencing_token IS NOT NULL)))),
    CONSTRAINT fencegate_jobs_heartbeat_seconds_check CHECK ((heartbeat_seconds > (0)::double precision)),
    CONSTRAINT fencegate_jobs_jitter_seconds_check CHECK ((jitter_seconds >= (0)::double precision)),
    CONSTRAINT fencegate_jobs_lease_seconds_check CHECK ((lease_seconds > (0)::double precision)),
    CONSTRAINT fencegate_jobs_max_attempts_check CHECK ((max_attempts >= 1)),
    CONSTRAINT fencegate_jobs_state_check CHECK ((state = ANY (ARRAY['queued'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text])))
)
WITH (fillfactor='70');

-- Name: fencegate_jobs_id_seq; Type: SEQUENCE

ALTER TABLE fencegate_jobs ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME fencegate_jobs_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: fencegate_rate_limits; Type: TABLE

CREATE TABLE fencegate_rate_limits (
    provider text NOT NULL,
    capacity double precision NOT NULL,
    per_seconds double precision NOT NULL,
    tokens double precision NOT NULL,
    refilled_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT fencegate_rate_limits_capacity_check CHECK ((capacity >= (1)::double precision)),
    CONSTRAINT fencegate_rate_limits_per_seconds_check CHECK ((per_seconds > (0)::double precision))
);

-- Name: fencegate_signature_nonces; Type: TABLE

CREATE TABLE fencegate_signature_nonces (
    key_id text NOT NULL,
    nonce text NOT NULL,
    expires_at timestamp with time zone NOT NULL
);

-- Name: fencegate_work_classes; Type: TABLE

CREATE TABLE fencegate_work_classes (
    kind text NOT NULL,
    max_running integer,
    max_running_per_key integer,
    provider text,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT fencegate_work_classes_max_running_check CHECK ((max_running >= 1)),
    CONSTRAINT fencegate_work_classes_max_running_per_key_check CHECK ((max_running_per_key >= 1))
);

-- Name: fencegate_audit fencegate_audit_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_audit
    ADD CONSTRAINT fencegate_audit_pkey PRIMARY KEY (id);

-- Name: fencegate_decisions fencegate_decisions_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_decisions
    ADD CONSTRAINT fencegate_decisions_pkey PRIMARY KEY (id);

-- Name: fencegate_gateways fencegate_gateways_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_gateways
    ADD CONSTRAINT fencegate_gateways_pkey PRIMARY KEY (instance);

-- Name: fencegate_job_attempts fencegate_job_attempts_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_job_attempts
    ADD CONSTRAINT fencegate_job_attempts_pkey PRIMARY KEY (fencing_token);

-- Name: fencegate_job_stages fencegate_job_stages_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_job_stages
    ADD CONSTRAINT fencegate_job_stages_pkey PRIMARY KEY (job_id, name);

-- Name: fencegate_jobs fencegate_jobs_idempotency_key_key; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_jobs
    ADD CONSTRAINT fencegate_jobs_idempotency_key_key UNIQUE (idempotency_key);

-- Name: fencegate_jobs fencegate_jobs_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_jobs
    ADD CONSTRAINT fencegate_jobs_pkey PRIMARY KEY (id);

-- Name: fencegate_rate_limits fencegate_rate_limits_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_rate_limits
    ADD CONSTRAINT fencegate_rate_limits_pkey PRIMARY KEY (provider);

-- Name: fencegate_work_classes fencegate_work_classes_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_work_classes
    ADD CONSTRAINT fencegate_work_classes_pkey PRIMARY KEY (kind);

-- Name: fencegate_fences fences_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_fences
    ADD CONSTRAINT fences_pkey PRIMARY KEY (tenant, entity);

-- Name: fencegate_idempotency_keys idempotency_keys_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant, key);

-- Name: fencegate_signature_nonces signature_nonces_pkey; Type: CONSTRAINT

ALTER TABLE ONLY fencegate_signature_nonces
    ADD CONSTRAINT signature_nonces_pkey PRIMARY KEY (key_id, nonce);

-- Name: fencegate_decisions_entity; Type: INDEX

CREATE INDEX fencegate_decisions_entity ON fencegate_decisions USING btree (tenant, entity, id) WHERE (entity IS NOT NULL);

-- Name: fencegate_decisions_key; Type: INDEX

CREATE INDEX fencegate_decisions_key ON fencegate_decisions USING btree (tenant, key, id) WHERE (key IS NOT NULL);

-- Name: fencegate_idempotency_keys_expires_at; Type: INDEX

CREATE INDEX fencegate_idempotency_keys_expires_at ON fencegate_idempotency_keys USING btree (expires_at);

-- Name: fencegate_idempotency_keys_reconcile; Type: INDEX

CREATE INDEX fencegate_idempotency_keys_reconcile ON fencegate_idempotency_keys USING btree (reconcile_after) WHERE (reconcile_after IS NOT NULL);

-- Name: fencegate_job_attempts_job; Type: INDEX

CREATE INDEX fencegate_job_attempts_job ON fencegate_job_attempts USING btree (job_id, fencing_token);

-- Name: fencegate_jobs_queued; Type: INDEX

CREATE INDEX fencegate_jobs_queued ON fencegate_jobs USING btree (kind, priority DESC, id) WHERE (state = 'queued'::text);

-- Name: fencegate_jobs_queued_any; Type: INDEX

CREATE INDEX fencegate_jobs_queued_any ON fencegate_jobs USING btree (priority DESC, id) WHERE (state = 'queued'::text);

-- Name: fencegate_jobs_running; Type: INDEX

CREATE INDEX fencegate_jobs_running ON fencegate_jobs USING btree (kind, lease_until) WHERE (state = 'running'::text);

-- Name: fencegate_signature_nonces_expires_at; Type: INDEX

CREATE INDEX fencegate_signature_nonces_expires_at ON fencegate_signature_nonces USING btree (expires_at);

-- Name: fencegate_job_attempts fencegate_job_attempts_job_id_fkey; Type: FK CONSTRAINT

ALTER TABLE ONLY fencegate_job_attempts
    ADD CONSTRAINT fencegate_job_attempts_job_id_fkey FOREIGN KEY (job_id) REFERENCES fencegate_jobs(id) ON DELETE CASCADE;

-- Name: fencegate_job_stages fencegate_job_stages_job_id_fkey; Type: FK CONSTRAINT

ALTER TABLE ONLY fencegate_job_stages
    ADD CONSTRAINT fencegate_job_stages_job_id_fkey FOREIGN KEY (job_id) REFERENCES fencegate_jobs(id) ON DELETE CASCADE;
