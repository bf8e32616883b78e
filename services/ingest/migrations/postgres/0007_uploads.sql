-- Direct uploads: a photo a client sends to the object store itself (a presigned PUT on S3),
-- reserved by CreateUpload and named by a later Submit. The row says whose it is, what was
-- declared (the type and the exact size the URL was signed for), until when it may be submitted,
-- and, once it was, the job it became (an upload is submitted once). Rows past their expiry are
-- swept, with the objects of those never submitted. Additive: an earlier replica never reads it.
CREATE TABLE IF NOT EXISTS scan_uploads (
    id            TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL,
    object_key    TEXT NOT NULL,
    content_type  TEXT NOT NULL,
    size_bytes    BIGINT NOT NULL,
    created_at_us BIGINT NOT NULL,
    expires_at_us BIGINT NOT NULL,
    job_id        TEXT
);

-- The sweep's scan: uploads by expiry.
CREATE INDEX IF NOT EXISTS scan_uploads_expiry ON scan_uploads (expires_at_us);
