"""What each page and fragment of the dashboard shows: one module per area (the main page and
its parts: processes, devices, commands; a job's page; the dialogs' target forms; the audit
log), each a function that reads it through the API's storage functions in one transaction
(run with ``ctx.db.call``) and returns a frozen dataclass whose fields are the template's names."""
