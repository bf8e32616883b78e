-- What the reconcile sweep and the reload at start page through, earliest due first: the
-- (due time, id) of every scheduled row, so a page is an index range whatever the number of
-- delivered rows. It covers what `notifications_pending` served, which goes.
CREATE INDEX notifications_scheduled
    ON notifications (due_at_us, id) WHERE status = 'scheduled';

DROP INDEX notifications_pending;
