-- 0004_checkpoints: the conversation and the tool-call checkpoints of each run.

-- The conversation, oldest first. Each row is written once (storage grows linearly with the
-- run, never by re-storing the whole history per step).
CREATE TABLE runpool.messages (
    run_id     uuid NOT NULL REFERENCES runpool.runs (id) ON DELETE CASCADE,
    seq        integer NOT NULL CONSTRAINT seq_positive CHECK (seq > 0),
    role       text NOT NULL CONSTRAINT role_length CHECK (length(role) BETWEEN 1 AND 64),
    content    jsonb NOT NULL,
    -- The attempt that wrote it: a fenced write never lands, so this is always a lease holder.
    attempt    integer NOT NULL,
    -- The tool call this message reports, for tool messages.
    call_id    text,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq)
);

-- One row per tool call: the intent (status 'started', result NULL) is committed before the
-- tool runs; the result is committed with its tool message in one transaction.
CREATE TABLE runpool.tool_calls (
    run_id      uuid NOT NULL REFERENCES runpool.runs (id) ON DELETE CASCADE,
    call_id     text NOT NULL CONSTRAINT call_id_length CHECK (length(call_id) BETWEEN 1 AND 200),
    name        text NOT NULL CONSTRAINT name_length CHECK (length(name) BETWEEN 1 AND 200),
    arguments   jsonb NOT NULL,
    status      text NOT NULL CONSTRAINT tool_status_known
        CHECK (status IN ('started', 'succeeded', 'failed', 'unknown')),
    result      jsonb,
    attempt     integer NOT NULL,
    -- How many times the tool was started (more than one only for retried interruptions).
    executions  integer NOT NULL DEFAULT 1,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    PRIMARY KEY (run_id, call_id),
    CONSTRAINT result_when_finished CHECK ((status = 'started') = (finished_at IS NULL))
);

GRANT SELECT ON runpool.messages, runpool.tool_calls TO runpool_api;
GRANT SELECT, INSERT, UPDATE, DELETE ON runpool.messages, runpool.tool_calls TO runpool_worker;
